"""Gradient-norm clipping over the shards of every group: one all-reduce for the whole model."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from ragfsdp.engine import collectives
from ragfsdp.engine.api import flat_groups


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale every group's `grad` so the global norm is at most `max_norm`, as
    `torch.nn.utils.clip_grad_norm_` does on the unsharded gradients; returns the total norm.
    Padding gradients are zero, so they do not count."""
    groups = [g for g in flat_groups(model) if g.grad is not None]
    if not groups:
        return torch.tensor(0.0)
    pgs = {id(g.process_group) for g in groups}
    if len(pgs) > 1:
        raise ValueError("clip_grad_norm_: the groups use different process groups; clip each separately")
    pg, dev = groups[0].process_group, groups[0].grad.device
    norm_type = float(norm_type)
    if math.isinf(norm_type):
        local = torch.stack([g.grad.detach().abs().max().float() for g in groups]).max()
        collectives.all_reduce(local, pg, dist.ReduceOp.MAX)
        total = local
    else:
        local = torch.stack([g.grad.detach().float().pow(norm_type).sum() for g in groups]).sum().to(dev)
        collectives.all_reduce(local, pg)
        total = local.pow(1.0 / norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in groups:
        g.grad.mul_(coef.to(g.grad.dtype))
    return total

"""`AdamW` on the local shards: one foreach update per flat buffer.

AdamW is elementwise, so updating a rank's whole shard at once is the same arithmetic as torch's
per-parameter loop: at one rank the parameters come out bit for bit as `torch.optim.AdamW(foreach=False)`
gives them. Moments follow the parameters' groups element for element (`exp_avg`, `exp_avg_sq`, torch's
keys); padding stays zero because its gradient and state are zero.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ragfsdp.engine.flat_group import FlatGroup
from ragfsdp.optim.base import FlatOptimizer, Run, torch_hyperparameters
from ragfsdp.optim.state_buffer import StateBuffer


def check_adamw_group(hyper: dict[str, Any]) -> None:
    """Refuse hyperparameters torch's AdamW has but this update does not implement."""
    for key in ("amsgrad", "capturable", "differentiable"):
        if hyper.get(key):
            raise ValueError(f"param group option {key}=True is not supported by ragfsdp.optim.AdamW; set it to False")


def adamw_foreach(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                  exp_avg_sqs: list[torch.Tensor], hyper: dict[str, Any], step: float) -> None:
    """torch's single-tensor AdamW step, op for op, over lists of tensors sharing one step count."""
    check_adamw_group(hyper)
    lr, (beta1, beta2), eps, wd = float(hyper["lr"]), hyper["betas"], hyper["eps"], hyper["weight_decay"]
    if hyper.get("maximize"):
        grads = torch._foreach_neg(grads)
    if wd != 0:
        torch._foreach_mul_(params, 1 - lr * wd)
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
    step_size = lr / (1 - beta1 ** step)
    bias_correction2_sqrt = (1 - beta2 ** step) ** 0.5
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, bias_correction2_sqrt)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(params, exp_avgs, denom, value=-step_size)


def views(buf: torch.Tensor, run: Run) -> list[torch.Tensor]:
    """The tensors of `buf` (a group's shard, gradient or a buffer following it) that `run` covers."""
    if run.pieces is None:
        return [buf]
    return [buf[pc.offset:pc.offset + pc.length] for pc in run.pieces]


class AdamW(FlatOptimizer):
    """torch.optim.AdamW (decoupled weight decay) on the local shards; same arguments and defaults."""

    granularity = None

    def __init__(self, model: nn.Module, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, maximize: bool = False) -> None:
        hyper = torch_hyperparameters(torch.optim.AdamW, lr=lr, betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay, maximize=maximize)
        super().__init__(model, hyper)
        self.exp_avg = [self.moment_buffer(g, "exp_avg") for g in self.groups]
        self.exp_avg_sq = [self.moment_buffer(g, "exp_avg_sq") for g in self.groups]

    def state_buffers(self) -> list[StateBuffer]:
        return [*self.exp_avg, *self.exp_avg_sq]

    def _update(self, gi: int, group: FlatGroup) -> None:
        assert group.grad is not None
        for run in self.runs(gi, group):
            adamw_foreach(views(group.shard, run), views(group.grad, run), views(self.exp_avg[gi].local, run),
                          views(self.exp_avg_sq[gi].local, run), run.hyper, run.step)

"""Equal-size collectives on flat buffers: the only communication the engine does.

torch 2.13 renamed `all_gather_into_tensor` / `reduce_scatter_tensor` to `all_gather_single` /
`reduce_scatter_single` (the old names warn); the new names are used when present.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather(full: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup | None, *,
               async_op: bool = False) -> dist.Work | None:
    """Every rank's `shard` into `full` (rank k's at `[k*S, (k+1)*S)`)."""
    if not dist.is_initialized():  # one process without a process group: the gather is the shard
        full.copy_(shard)
        return None
    return _all_gather(full, shard, group=group, async_op=async_op)


def reduce_scatter_sum(shard: torch.Tensor, full: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """Sum of every rank's `full` over this rank's slice into `shard` (gloo has no AVG op: callers divide)."""
    if not dist.is_initialized():
        shard.copy_(full)
        return
    _reduce_scatter(shard, full, op=dist.ReduceOp.SUM, group=group)


def all_reduce(t: torch.Tensor, group: dist.ProcessGroup | None, op: dist.ReduceOp = dist.ReduceOp.SUM) -> None:
    if dist.is_initialized():
        dist.all_reduce(t, op=op, group=group)

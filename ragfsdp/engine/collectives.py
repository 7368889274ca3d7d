"""Equal-size collectives on flat buffers: the only communication the engine does.

torch 2.13 renamed `all_gather_into_tensor` / `reduce_scatter_tensor` to `all_gather_single` /
`reduce_scatter_single` (the old names warn); the new names are used when present.

On gloo both are done with other collectives, measured faster and without gloo's full-size
temporaries: gloo's all-gather gathers into a temporary flat tensor of the full size and copies it
out, and its reduce-scatter copies the whole input, all-reduces the copy and copies this rank's slice
out. Here the all-gather is one broadcast per rank, each straight into its slice of the full buffer
(this rank's slice first filled from its shard, the copy every all-gather makes), and the
reduce-scatter is an in-place all-reduce of the (disposable) full buffer followed by the copy of
this rank's slice: the same sums, bit for bit, as gloo's reduce-scatter (the same all-reduce), less
one full-size copy. The full buffer's other slices are garbage afterwards; callers free it.
NCCL (and every other backend) uses the native collectives.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Pending:
    """One issued collective (possibly several works): `wait()` blocks until its output is valid,
    then runs what completes it (a copy-out), once."""

    def __init__(self, works: list[dist.Work | None], then: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        self._works = [w for w in works if w is not None]
        self._then = then
        self.done = False

    def wait(self) -> None:
        if self.done:
            return
        for w in self._works:
            w.wait()
        if self._then is not None:
            dst, src = self._then
            with torch.no_grad():
                dst.copy_(src)
        self._works, self._then, self.done = [], None, True


def _is_gloo(group: dist.ProcessGroup | None) -> bool:
    return dist.get_backend(group) == "gloo"


def all_gather(full: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup | None, *,
               async_op: bool = False) -> Pending:
    """Every rank's `shard` into `full` (rank k's at `[k*S, (k+1)*S)`)."""
    if not dist.is_initialized():  # one process without a process group: the gather is the shard
        full.copy_(shard)
        return Pending([])
    if not _is_gloo(group):
        res = Pending([_all_gather(full, shard, group=group, async_op=async_op)])
        if not async_op:
            res.done = True
        return res
    world, rank, S = dist.get_world_size(group), dist.get_rank(group), shard.numel()
    full[rank * S:(rank + 1) * S].copy_(shard)
    works = [dist.broadcast(full[k * S:(k + 1) * S], src=k if group is None else dist.get_global_rank(group, k),
                            group=group, async_op=True) for k in range(world)]
    res = Pending(works)
    if not async_op:
        res.wait()
    return res


def reduce_scatter_sum(shard: torch.Tensor, full: torch.Tensor, group: dist.ProcessGroup | None, *,
                       async_op: bool = False) -> Pending:
    """Sum of every rank's `full` over this rank's slice into `shard` (gloo has no AVG op: callers
    divide). On gloo `full` is overwritten (see the module docstring)."""
    if not dist.is_initialized():
        shard.copy_(full)
        return Pending([])
    if not _is_gloo(group):
        res = Pending([_reduce_scatter(shard, full, op=dist.ReduceOp.SUM, group=group, async_op=async_op)])
        if not async_op:
            res.done = True
        return res
    rank, S = dist.get_rank(group), shard.numel()
    res = Pending([dist.all_reduce(full, op=dist.ReduceOp.SUM, group=group, async_op=True)],
                  then=(shard, full[rank * S:(rank + 1) * S]))
    if not async_op:
        res.wait()
    return res


def all_reduce(t: torch.Tensor, group: dist.ProcessGroup | None, op: dist.ReduceOp = dist.ReduceOp.SUM) -> None:
    if dist.is_initialized():
        dist.all_reduce(t, op=op, group=group)

"""The checkpointer's own process groups: agreeing on when to save and on whether a save
succeeded, without ever putting a collective on the training group's stream.

Two gloo groups, because the decision to save is taken in the training loop's thread while the
success count of a background save is gathered in the writer's thread: one group per thread keeps
every rank's collectives in one order. Without torch.distributed (one process) everything is local.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class Coordinator:
    """Collectives of Python objects among all ranks of the default group, on side groups."""

    def __init__(self) -> None:
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        # every rank makes both groups, in this order, at construction: new_group is collective
        self._loop_group = dist.new_group(backend="gloo") if self.distributed else None
        self._writer_group = dist.new_group(backend="gloo") if self.distributed else None

    def _group(self, writer: bool) -> Any:
        return self._writer_group if writer else self._loop_group

    def broadcast(self, obj: Any, *, writer: bool = False) -> Any:
        """Rank 0's `obj` on every rank."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self._group(writer))
        return box[0]

    def gather(self, obj: Any, *, writer: bool = False) -> list[Any]:
        """Every rank's `obj`, in rank order, on every rank."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self._group(writer))
        return out

    def all_true(self, flag: bool) -> bool:
        """Whether `flag` holds on every rank (on the training thread's side group): lets every rank
        act on a local observation (a writer thread that ended) at the same step."""
        if not self.distributed:
            return bool(flag)
        t = torch.tensor([1 if flag else 0], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self._loop_group)
        return bool(t.item())

    def barrier(self) -> None:
        """All ranks got here (on the training thread's side group)."""
        if self.distributed:
            dist.barrier(group=self._loop_group)

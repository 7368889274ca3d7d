"""`FlatGroup`: one dtype's parameters of one `fully_shard` unit, as one flat buffer per rank.

The group's `FlatLayout` (from `ragckpt.plan_layout`) puts parameter `t` at global flat offset
`offsets[t]` of a virtual `W * S` buffer whose rank-k slice `[k*S, (k+1)*S)` is rank k's `shard`.
So the unsharded state needs no copy in or out: the all-gathered full buffer *is* the storage of the
parameters (each `p.data` is a fixed view `full[offset:offset+numel].view(shape)`), and each `p.grad`
is a view of one zeroed full-gradient buffer laid out the same way, which autograd accumulates into
in place and which is reduce-scattered as it is. Freeing the unsharded state resizes the full
buffers' storage to zero bytes (as FSDP1 does); the views stay bound and become valid again when
the next all-gather refills the same storage, which is also what the tensors autograd saved in the
forward rely on.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

import ragckpt
from ragfsdp.engine import collectives


class Piece(NamedTuple):
    """Parameter `name`'s flat elements `[flat_start, flat_start + length)` live at
    `shard[offset:offset + length]`."""

    slot: int
    name: str
    shape: tuple[int, ...]
    flat_start: int
    offset: int
    length: int


class Stats:
    """Bytes moved by one group: `copy_bytes` are copies outside collectives (mixed-precision
    casts, a gradient autograd did not accumulate in place); the others are collective payloads."""

    __slots__ = ("all_gather_bytes", "all_gathers", "copy_bytes", "reduce_scatter_bytes", "reduce_scatters")

    def __init__(self) -> None:
        self.copy_bytes = self.all_gather_bytes = self.reduce_scatter_bytes = 0
        self.all_gathers = self.reduce_scatters = 0


class FlatGroup:
    """See the module docstring. Public attributes are read-only except `grad` (optimizers set it to
    None) and the values of `shard` (updated in place, never rebound; padding stays zero)."""

    def __init__(self, local_names: list[str], params: list[nn.Parameter], layout: ragckpt.FlatLayout,
                 compute_dtype: torch.dtype, reduce_dtype: torch.dtype,
                 process_group: dist.ProcessGroup | None, rank: int, world_size: int) -> None:
        self.local_names = tuple(local_names)
        self.param_names = self.local_names  # root-relative once the root is known (bind_prefix)
        self.buffer_name = ""
        self.params = tuple(params)
        self.shapes = tuple(tuple(p.shape) for p in params)
        self.dtype = params[0].dtype
        self.compute_dtype = compute_dtype
        self.reduce_dtype = reduce_dtype
        self.layout = layout
        self.process_group = process_group
        self.rank = rank
        self.world_size = world_size
        self.device = params[0].device
        self.stats = Stats()
        S = layout.shard_size
        self.shard = torch.zeros(S, dtype=self.dtype, device=self.device)
        self._grad: torch.Tensor | None = None
        with torch.no_grad():
            flat_src = [p.detach().reshape(-1) for p in params]
            for pc in self.pieces():
                self.shard[pc.offset:pc.offset + pc.length] = flat_src[pc.slot][pc.flat_start:pc.flat_start + pc.length]
        self.full = torch.empty(world_size * S, dtype=compute_dtype, device=self.device)
        offs = layout.offsets
        for p, o, shape in zip(params, offs, self.shapes, strict=True):
            n = p.numel()
            p.data = self.full[o:o + n].view(shape)
        self._full_bytes = self.full.untyped_storage().nbytes()
        self.full.untyped_storage().resize_(0)
        self.full_grad: torch.Tensor | None = None
        self._grad_views: list[torch.Tensor] = []
        self._work: collectives.Pending | None = None
        self._send: torch.Tensor | None = None
        self._reduce: tuple[collectives.Pending, torch.Tensor, torch.Tensor] | None = None

    def bind_prefix(self, prefix: str, unit_name: str) -> None:
        self.param_names = tuple(prefix + n for n in self.local_names)
        self.buffer_name = f"params.{unit_name}.{str(self.dtype).removeprefix('torch.')}"

    def pieces(self) -> list[Piece]:
        seg = self.layout.rank_segments(self.rank)
        return [Piece(int(s), self.local_names[int(s)] if not self.buffer_name else self.param_names[int(s)],
                      self.shapes[int(s)], int(f), int(o), int(n))
                for s, f, o, n in zip(seg.slot, seg.flat_start, seg.offset, seg.length, strict=True)]

    # -- parameters ----------------------------------------------------------------------------------
    @property
    def is_unsharded(self) -> bool:
        return self.full.untyped_storage().nbytes() > 0

    def unshard(self, *, async_op: bool = False) -> None:
        """Refill the full buffer (the parameters' storage) from every rank's shard."""
        if self.is_unsharded:
            return
        self.full.untyped_storage().resize_(self._full_bytes)
        src = self.shard
        if self.compute_dtype != self.dtype:
            src = self.shard.to(self.compute_dtype)
            self.stats.copy_bytes += src.numel() * src.element_size()
        self._send = src
        self.stats.all_gathers += 1
        self.stats.all_gather_bytes += self._full_bytes
        # the collective writes into storage that the forward's saved tensors point to; they must
        # see the refilled values, not fail autograd's in-place check, so the version is preserved
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(self.full):
            self._work = collectives.all_gather(self.full, src, self.process_group, async_op=async_op)

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None
            self._send = None

    def reshard(self) -> None:
        self.wait()
        self.full.untyped_storage().resize_(0)

    # -- gradients -----------------------------------------------------------------------------------
    def bind_grads(self) -> None:
        """Point every `p.grad` at its view of the (zeroed, on first use) full-gradient buffer."""
        if self.full_grad is None:
            self.full_grad = torch.zeros(self.full.numel(), dtype=self.compute_dtype, device=self.device)
            self._grad_views = [self.full_grad[o:o + p.numel()].view(p.shape)
                                for p, o in zip(self.params, self.layout.offsets, strict=True)]
        for p, v in zip(self.params, self._grad_views, strict=True):
            if p.requires_grad and p.grad is not v:
                if p.grad is not None:  # accumulated outside the buffer (used outside its unit's forward)
                    v.add_(p.grad)
                    self.stats.copy_bytes += p.grad.numel() * p.grad.element_size()
                p.grad = v

    def reduce_grads(self, *, async_op: bool = False) -> None:
        """Reduce-scatter the full-gradient buffer (averaged over ranks) into `grad`, then free it.
        With `async_op` the collective is only issued (the parameters' `.grad` views are unbound at
        once, the buffer is kept until it completes): `wait_reduce` finishes it, so the backward of
        the units before this one runs while it is in flight."""
        if self.full_grad is None:
            return
        self.wait_reduce()  # one reduction per group in flight: the next one adds to `grad`
        red = self.full_grad
        if self.reduce_dtype != red.dtype:
            red = red.to(self.reduce_dtype)
            self.stats.copy_bytes += red.numel() * red.element_size()
        out = torch.empty(self.layout.shard_size, dtype=self.reduce_dtype, device=self.device)
        work = collectives.reduce_scatter_sum(out, red, self.process_group, async_op=async_op)
        self.stats.reduce_scatters += 1
        self.stats.reduce_scatter_bytes += red.numel() * red.element_size()
        self._reduce = (work, out, red)
        self.free_grads()  # `red` (the buffer itself, or its cast) stays referenced until the wait
        if not async_op:
            self.wait_reduce()

    @property
    def reduce_pending(self) -> bool:
        return self._reduce is not None

    def wait_reduce(self) -> None:
        """Finish an issued reduce-scatter: wait, average, cast to the master dtype, add to `grad`."""
        if self._reduce is None:
            return
        work, out, _ = self._reduce
        self._reduce = None
        work.wait()
        if self.world_size > 1:
            out.div_(self.world_size)
        if out.dtype != self.dtype:
            out = out.to(self.dtype)
            self.stats.copy_bytes += out.numel() * out.element_size()
        if self._grad is None:
            self._grad = out
        else:
            self._grad.add_(out)

    @property
    def grad(self) -> torch.Tensor | None:
        """This rank's averaged gradient shard. A reduce-scatter still in flight is finished first, so
        the backward returns before the last units' reductions complete and an optimizer stepping the
        groups in order overlaps the root's (the last to start) with its work on the blocks."""
        self.wait_reduce()
        return self._grad

    @grad.setter
    def grad(self, value: torch.Tensor | None) -> None:
        self.wait_reduce()
        self._grad = value

    def free_grads(self) -> None:
        for p in self.params:
            p.grad = None
        self.full_grad = None
        self._grad_views = []

    def __repr__(self) -> str:
        return (f"FlatGroup({self.buffer_name or self.local_names[:3]}, {len(self.params)} params, "
                f"{self.dtype}, rank {self.rank}/{self.world_size}, shard {self.layout.shard_size})")

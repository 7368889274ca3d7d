"""Saving in the background: training waits only while each rank's buffers are copied to host memory.

A save writes from the tensors it is given, so the engine must not change them until the write is
done; `save_shard` therefore blocks a training step for as long as the storage takes. Here the
buffers are first copied (the device-to-host copy a GPU job needs anyway) into page-aligned host
buffers, which local disks are written from with no further copy, and a per-process writer thread
writes from the copy while training goes on.

The writer is one thread per process, so a process's saves run one after another in the order they
were started. That order is what lets background saves of many ranks run collectives (the FSDP2
adapter gathers the ranks' records and commits from its writer thread): every rank's writer meets
the others in the same sequence.

`StagingBuffers` keeps the host copies between saves. The first save allocates and first-touches
them (on this kind of machine about as slow as the write itself); later saves copy into the same
memory. The price is host memory the size of the rank's share, held until `release()`.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, wait
from contextlib import contextmanager
from typing import TYPE_CHECKING

from ragckpt.checkpoint import manifest as mf
from ragckpt.checkpoint.save_queue import submit_save
from ragckpt.checkpoint.writer import check_padding_is_zero, check_shard, extra_bytes, write_shard
from ragckpt.format.runs import copy_bits, flat_bits
from ragckpt.planner.state import CheckpointLayout
from ragckpt.storage.checksum import DEFAULT_BLOCK_BYTES
from ragckpt.storage.direct import aligned_empty
from ragckpt.storage.store import as_url

if TYPE_CHECKING:
    import torch
else:
    from ragckpt.lazy import torch

class StagingBuffers:
    """Host copies of one rank's buffers, reused from one background save to the next.

    Pass the same object to every `save_shard_async` (or FSDP2 `async_save_state_dict`) of a rank: a
    save first waits for the previous save that used it to finish writing, then copies into the
    buffers it already has. One object serves one rank's saves, one at a time: saves started from
    several threads at once take turns (see `claimed`)."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._pending: Future | None = None
        self._claim = threading.Lock()

    @contextmanager
    def claimed(self) -> Iterator[StagingBuffers]:
        """Held by a save from its copy until its future is handed over (`hold`): a second save
        started meanwhile from another thread waits here, then for the first to finish writing,
        rather than copy into buffers the first is still filling or writing from."""
        with self._claim:
            yield self

    @property
    def nbytes(self) -> int:
        """Host memory held."""
        return sum(t.numel() * t.element_size() for t in self._buffers.values())

    def wait(self) -> None:
        """Block until the last save that used these buffers has finished with them. Its outcome,
        failure included, is its own future's to report."""
        if self._pending is not None:
            wait([self._pending])
            self._pending = None

    def take(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A page-aligned host buffer for `name`: the one kept from the last save when its size and
        dtype still fit, else a new one (zeroed, so layout padding never carries stray memory).
        Call `wait()` first."""
        have = self._buffers.get(name)
        if have is None or have.numel() != numel or have.dtype != dtype:
            have = self._buffers[name] = aligned_empty(numel, dtype).zero_()
        return have

    def hold(self, future: Future, names: set[str]) -> None:
        """The buffers `names` are in use until `future` is done; any others are let go."""
        self._buffers = {k: v for k, v in self._buffers.items() if k in names}
        self._pending = future

    def stage(self, buffers: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copies of `buffers` (any device, any strides) in the kept host memory."""
        self.wait()
        out = {}
        for name, t in buffers.items():
            flat = flat_bits(t.detach())
            out[name] = self.take(name, flat.numel(), flat.dtype)
            copy_bits(out[name], flat)
        return out

    def release(self) -> None:
        """Wait for the last save, then let the host memory go (the next save allocates again)."""
        self.wait()
        self._buffers = {}


def save_shard_async(
    url: str,
    rank: int,
    buffers: Mapping[str, torch.Tensor],
    layout: CheckpointLayout,
    *,
    extra: Mapping[str, torch.Tensor] | None = None,
    extra_meta: Mapping[str, str] | None = None,
    user: dict | None = None,
    storage_options: dict | None = None,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    max_chunk_bytes: int = mf.DEFAULT_MAX_CHUNK_BYTES,
    save_id: str | None = None,
    staging: StagingBuffers | None = None,
) -> Future[dict]:
    """`save_shard` in the background: returns once `buffers` and `extra` are copied, so the engine
    may update them right away; the future gives what `save_shard` returns (the rank's record for
    `commit`) or raises what it raised. Arguments are checked before anything is copied, and bad ones
    raise here. `staging` keeps the host copies for the next save (see `StagingBuffers`); without
    it each save allocates its own. Commit once every rank's future is done."""
    url = as_url(url)  # a bad one raises here, not in the writer thread
    check_shard(rank, buffers, layout, extra=extra, extra_meta=extra_meta, user=user, block_bytes=block_bytes,
                max_chunk_bytes=max_chunk_bytes, save_id=save_id)
    raw = extra_bytes(extra, extra_meta)
    # the values of the call, as for the buffers: a caller may update its dicts right away
    user = copy.deepcopy(user)
    storage_options = copy.deepcopy(storage_options)
    if staging is not None and not isinstance(staging, StagingBuffers):
        raise TypeError(f"rank {rank}: staging must be a ragckpt.StagingBuffers (kept for the whole job), got "
                        f"{type(staging).__name__}")
    staging = staging if staging is not None else StagingBuffers()
    with staging.claimed():
        flats = staging.stage({spec.name: buffers[spec.name] for spec in layout.buffers})
        for bi, spec in enumerate(layout.buffers):  # an argument error too: raised here, not by the future
            check_padding_is_zero(layout, bi, int(rank), flats[spec.name])
        future = submit_save(lambda: write_shard(url, int(rank), flats, layout, raw_extra=raw, user=user,
                                                 storage_options=storage_options, block_bytes=block_bytes,
                                                 max_chunk_bytes=max_chunk_bytes, save_id=save_id), url=url)
        staging.hold(future, set(flats))
    return future


__all__ = ["StagingBuffers", "save_shard_async"]

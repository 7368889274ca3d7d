"""Checksum blocks verified from pieces read by different fills.

Every stored block has one crc32c, so a plain range read is widened to whole blocks. Where many
small destination fills each need a different piece of the same source block (a 2048-rank source of
128 KiB rank buffers going to 8 ragged ranks: every destination chunk takes a slice of every source
block), each fill read the whole block again: 12.6x the checkpoint's bytes. Here each fill reads
only its piece and leaves that piece's crc; once a block's pieces cover it, their crcs are combined
(`crc32c_combine`) and compared with the stored one. The bytes were already copied into place by
then; the destination is committed only after every block is verified (`complete` reads whatever no
fill did: padding, or pieces another process took), so a corrupt source still fails the job and
leaves nothing committed.

Held per incomplete block: its pieces' offsets and crcs, a few dozen bytes each. Blocks leave as
soon as they are whole, so what stays is the edges of the ranges in flight.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import numpy as np

from ragckpt.storage.checksum import crc32c_combine

if TYPE_CHECKING:
    from ragckpt.checkpoint.reader import Checkpoint

#: gap bytes read per `read_pieces` call while completing
_COMPLETE_BATCH_BYTES = 16 << 20


class PartialBlocks:
    """The pieces of source blocks read so far, per (buffer, rank, block), for one checkpoint;
    shared by every thread of a process (`add` takes a lock)."""

    def __init__(self, ck: Checkpoint):
        self.ck = ck
        self._pieces: dict[tuple[int, int, int], dict[int, tuple[int, int]]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._pieces)

    def add(self, bi: int, rank: int, block: int, lo: int, hi: int, crc: int) -> None:
        """Record that bytes [lo, hi) of block `block` (offsets within the block) were read and had
        crc32c `crc`; verify the block once its pieces cover it."""
        key = (bi, rank, block)
        with self._lock:
            have = self._pieces.setdefault(key, {})
            for s, (e, _) in have.items():
                if s < hi and lo < e:  # a plan never reads a source byte twice; the crcs could not be combined
                    raise RuntimeError(f"buffer {bi} rank {rank} block {block}: bytes [{lo}, {hi}) were read twice "
                                       f"(overlap with [{s}, {e})); a bug in ragckpt, please report it")
            have[lo] = (hi, crc)
            if sum(e - s for s, (e, _) in have.items()) < self.ck.block_length(bi, rank, block):
                return
            del self._pieces[key]
        self._verify(bi, rank, block, have)

    def _verify(self, bi: int, rank: int, block: int, pieces: dict[int, tuple[int, int]]) -> None:
        crc = None
        for s in sorted(pieces):
            e, c = pieces[s]
            crc = c if crc is None else crc32c_combine(crc, c, e - s)
        self.ck.check_block_crc(bi, rank, block, crc)

    def gaps(self) -> list[tuple[int, int, int, int]]:
        """(buffer, rank, first byte, last byte + 1) of every part of an incomplete block no piece covers,
        in rank-buffer offsets."""
        out = []
        with self._lock:
            items = [(k, sorted((s, e) for s, (e, _) in v.items())) for k, v in self._pieces.items()]
        for (bi, rank, block), spans in items:
            base = block * self.ck.block_bytes
            pos = 0
            for s, e in [*spans, (self.ck.block_length(bi, rank, block),) * 2]:
                if s > pos:
                    out.append((bi, rank, base + pos, base + s))
                pos = max(pos, e)
        return out

    def complete(self) -> int:
        """Read every byte of the incomplete blocks that no fill read, so that each is verified (its
        bytes are not kept). Returns the bytes read; raises IntegrityError for a block that does not
        match its checksum."""
        gaps = sorted(self.gaps())
        total = 0
        i = 0
        while i < len(gaps):
            bi = gaps[i][0]
            batch, size = [], 0
            while i < len(gaps) and gaps[i][0] == bi and (not batch or size + gaps[i][3] - gaps[i][2] <= _COMPLETE_BATCH_BYTES):
                batch.append(gaps[i])
                size += gaps[i][3] - gaps[i][2]
                i += 1
            scratch = memoryview(np.empty(size, dtype=np.uint8))
            reqs, pos = [], 0
            for _, rank, a, b in batch:
                reqs.append((rank, a, [scratch[pos : pos + b - a]]))
                pos += b - a
            self.ck.read_pieces(bi, reqs, self)
            total += size
        if self._pieces:  # every gap was read, so every block was checked: a store that skipped one is wrong
            raise RuntimeError(f"{len(self._pieces)} source blocks were left unverified; a bug in ragckpt, please "
                               "report it")
        return total


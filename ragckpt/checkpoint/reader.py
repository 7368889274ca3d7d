"""Reading: metadata once, then checksum-verified range reads of exactly the bytes asked for.

Every read goes through `read_rank_ranges`: requested byte ranges of rank buffers are widened to
whole checksum blocks, fetched in one batch (concurrently on object stores), verified block by block
and cut back. Nothing ever reads a whole tensor or object it does not need.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ragckpt.checkpoint import documents
from ragckpt.checkpoint import manifest as mf
from ragckpt.checkpoint.writer import (
    DEFAULT_MEMORY_BYTES,
    check_memory_budget,
    decode_table,
    default_workers,
    table_chunk_key,
)
from ragckpt.errors import (
    RESAVE_BIN_WEIGHTS,
    BadObjectError,
    CorruptMarkerError,
    FormatError,
    IntegrityError,
    LayoutError,
    NotCommittedError,
    OutOfRangeError,
    StorageError,
)
from ragckpt.format.dtypes import as_bytes, from_bytes, itemsize, torch_dtype
from ragckpt.format.layout import BufferLayout, DeferredUnits
from ragckpt.format.placement import RaggedShard, numel_of
from ragckpt.format.runs import copy_bits, copy_runs
from ragckpt.planner.state import CheckpointLayout
from ragckpt.storage.checksum import block_crcs, crc32c
from ragckpt.storage.direct import ThreadBuffers
from ragckpt.storage.store import UNREADABLE, Store, open_store
from ragckpt.workpool import bounded_map

if TYPE_CHECKING:
    import torch

    from ragckpt.checkpoint.partial import PartialBlocks
else:
    from ragckpt.lazy import torch


@dataclass(frozen=True)
class TensorMeta:
    name: str
    shape: tuple[int, ...]
    dtype: str
    buffer: str
    slot: int
    _layout: BufferLayout = field(repr=False, compare=False)

    @property
    def placement(self) -> RaggedShard:
        """The tensor's RaggedShard (computed on demand: it is W integers long)."""
        return self._layout.placement(self.slot)

    @property
    def sharded_dims(self) -> int:
        """How many leading dims the placement flattens (`len(placement.dims)`), without computing
        the placement, which reads the layout's units table."""
        return self._layout.dims[self.slot]

    @property
    def numel(self) -> int:
        return numel_of(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * itemsize(self.dtype)


#: a units table at most this large decoded is read when the checkpoint is opened; a larger one when
#: something first needs it (see `Checkpoint._units_table`)
EAGER_TABLE_BYTES = 64 << 20
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_META_LOCK = threading.RLock()


def zstd_content_size(raw: bytes) -> int | None:
    """The decoded size a zstd frame's header declares (RFC 8878, section 3.1.1.1), None when the
    bytes are no zstd frame or it declares none: lets a reader refuse a wrong table before it
    allocates what the frame would decode to."""
    if len(raw) < 6 or bytes(raw[:4]) != ZSTD_MAGIC:
        return None
    fhd = raw[4]
    fcs_flag, single = fhd >> 6, (fhd >> 5) & 1
    size = (0, 1, 2, 4, 8)[fcs_flag + 1] if fcs_flag else (1 if single else 0)
    if not size:
        return None
    pos = 5 + (0 if single else 1) + (0, 1, 2, 4)[fhd & 3]
    if len(raw) < pos + size:
        return None
    value = int.from_bytes(raw[pos : pos + size], "little")
    return value + 256 if size == 2 else value


class _OnDemand(dict):
    """A dict whose missing entries `load(key)` fills in (it may fill sibling tables at once)."""

    def __init__(self, load: Callable[[int], None]):
        super().__init__()
        self._load = load

    def __missing__(self, key: int) -> np.ndarray:
        with _META_LOCK:  # reader threads may all miss at once: load once
            if not dict.__contains__(self, key):
                self._load(key)
        return dict.__getitem__(self, key)


@dataclass
class VerifyReport:
    objects: int = 0
    bytes: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _refuse_foreign_format(store: Store, url: str) -> None:
    """A DCP checkpoint, a Hugging Face or plain PyTorch model given where a checkpoint was expected
    gets the command that converts it, not just "no checkpoint here"."""
    if store.exists(".metadata"):
        raise FormatError(f"{url} is a torch.distributed.checkpoint (DCP) directory, not a ragckpt "
                          "checkpoint; convert it with `ragckpt import-dcp` (or read it with dcp.load)")
    if url.endswith(".safetensors"):
        raise FormatError(f"{url} is a safetensors file, not a ragckpt checkpoint; convert it with "
                          "`ragckpt import-hf`")
    if url.endswith((".bin", ".pt", ".pth")):
        raise FormatError(f"{url} looks like a torch.save file, not a ragckpt checkpoint; re-save its tensors as "
                          "safetensors and run `ragckpt import-hf`")
    if store.exists("model.safetensors") or store.exists("model.safetensors.index.json"):
        raise FormatError(f"{url} is a Hugging Face safetensors model directory, not a ragckpt checkpoint; "
                          "convert it with `ragckpt import-hf`")
    if store.exists("pytorch_model.bin") or store.exists("pytorch_model.bin.index.json"):
        raise FormatError(f"{url} holds PyTorch .bin weights, not a ragckpt checkpoint; {RESAVE_BIN_WEIGHTS}, "
                          "then run `ragckpt import-hf`")


class Checkpoint:
    """A checkpoint opened for reading (see `ragckpt.open`)."""

    def __init__(self, url: str, *, storage_options: dict | None = None, allow_uncommitted: bool = False):
        self.store: Store = open_store(url, storage_options)
        self.url = self.store.url
        self.committed = self.store.exists(mf.COMMIT_KEY)
        if self.committed:
            self._require_marker_object()
        has_root = self.store.exists(mf.ROOT_META_KEY)
        if not has_root:
            self.store.check_root()
            if self.committed:
                raise FormatError(f"{self.url} has a {mf.COMMIT_KEY} marker but no zarr.json: the checkpoint's root "
                                  "document was deleted; restore it or re-save the checkpoint")
            _refuse_foreign_format(self.store, self.url)
            if mf.holds_rank_objects(self.store):
                raise NotCommittedError(f"{self.url} holds part of a ragckpt checkpoint but no zarr.json: its save "
                                        "did not finish (rank 0 never wrote the metadata); save it again")
            raise FormatError(f"no ragckpt checkpoint at {self.url} (no zarr.json found); check the path")
        if not self.committed and not allow_uncommitted:
            self._require_ragckpt_root()  # a plain zarr group is no checkpoint at all, committed or not
            raise NotCommittedError(
                f"{self.url} is not committed (no {mf.COMMIT_KEY} marker): its save was interrupted or is "
                "still running; re-run the save, or use the previous checkpoint"
            )
        self.marker: dict = {}
        expected: dict[str, int] = {}
        if self.committed:
            try:
                self.marker, expected = mf.parse_marker(self.store.read(mf.COMMIT_KEY))
            except ValueError:
                raise CorruptMarkerError(f"{self.url}/{mf.COMMIT_KEY} is corrupt; the checkpoint cannot be trusted: "
                                         "restore the marker from a copy, or re-save the checkpoint") from None
        root_raw = self._read_meta(mf.ROOT_META_KEY, expected)
        try:
            self.manifest = mf.manifest_from_root_doc(root_raw, self.url)
        except FormatError:
            self._require_ragckpt_root(root_raw)  # one of a checkpoint's arrays gets its own advice
            raise
        W = int(self.manifest["world_size"])
        self._expected = expected
        try:
            tables = {i: self._units_table(i, (len(e.get("shapes", ())), W))
                      for i, e in enumerate(self.manifest["layouts"]) if "units" in e}
        except IntegrityError as e:
            if self.committed:
                raise
            # rank 0 writes its tables after the root document: nothing to restore, the save did not finish
            what = str(e).split(": the checkpoint metadata")[0]  # the object, without the advice to restore it
            raise NotCommittedError(f"{self.url} is not committed: its save was interrupted or is still running, "
                                    f"before rank 0 finished writing the metadata ({what}); re-run the save, or "
                                    "use the previous checkpoint") from None
        self.layout: CheckpointLayout = mf.layout_from_manifest(self.manifest, tables, self.url)
        self.block_bytes = int(self.manifest["block_bytes"])
        self.max_chunk_bytes = int(self.manifest["max_chunk_bytes"])
        self._chunkings: dict[int, mf.Chunking] = {}
        self._nbytes: dict[int, np.ndarray] = {}
        # each buffer's checksum table and where each rank's blocks start in it; read at open unless its
        # layout's units table is deferred (see `_units_table`), else on the first read that needs it
        self._crc: dict[int, np.ndarray] = _OnDemand(self._load_crc)
        self._crc_start: dict[int, np.ndarray] = _OnDemand(self._load_crc)
        # each thread's scratch for the partial checksum blocks around a range read (at most two
        # blocks; mapped on a thread's first such read)
        self._scratch = ThreadBuffers()
        if self.committed:
            for bi in range(len(self.layout.buffers)):
                if not self.layout.layout_of(bi).pending:
                    self._load_crc(bi)
            self._extra = self._table("meta/extra", expected, (W, 2), np.int64)
            self._check_marker()

    # -- metadata ------------------------------------------------------------------------------------
    def _require_marker_object(self) -> None:
        """Raise FormatError when the commit marker is there but is no regular file (a dangling
        symlink, a directory, a pipe): such a checkpoint is damaged, and calling it "not committed"
        would send the user looking for an interrupted save that never happened."""
        problem = self.store.object_problem(mf.COMMIT_KEY)
        if problem is not None:
            raise FormatError(f"{self.store.child(mf.COMMIT_KEY)} is {problem}, not a regular file: the commit "
                              "marker is there but damaged, so the checkpoint cannot be trusted; restore the "
                              "marker or re-save the checkpoint")

    def _require_ragckpt_root(self, raw: bytes | None = None) -> None:
        """Raise FormatError when the root zarr.json is valid JSON but no ragckpt manifest: a plain zarr
        group or array, or one of a checkpoint's own arrays. An unparseable one is left to the caller:
        it may be the torn document of an interrupted save, which "not committed" describes."""
        if raw is None:
            raw = self.store.read(mf.ROOT_META_KEY)
        kind = mf.root_doc_kind(raw)
        if kind == "array":
            raise FormatError(f"{self.url} is an array inside a ragckpt checkpoint, not a checkpoint; give the "
                              "checkpoint's root directory")
        if kind == "zarr":
            mf.manifest_from_root_doc(raw, self.url)  # raises, worded as for every non-ragckpt zarr.json
            raise FormatError(f"{self.url} is not a ragckpt checkpoint; check the path")  # pragma: no cover

    def _check_marker(self) -> None:
        """The commit marker must describe this checkpoint: a marker copied from another checkpoint,
        or edited, would otherwise vouch for metadata it never covered."""
        mk = self.marker
        for field_, want in (("format", mf.FORMAT_NAME), ("format_version", mf.FORMAT_VERSION),
                             ("world_size", self.layout.world_size), ("total_bytes", self.layout.total_bytes())):
            got = mk.get(field_)
            if type(got) is not type(want) or got != want:  # True == 1 and 1.0 == 1 in Python
                raise CorruptMarkerError(f"{self.url}/{mf.COMMIT_KEY} says {field_} {mf.brief(got)}, the "
                                         f"checkpoint {want!r}: the marker does not belong to this checkpoint; it "
                                         "cannot be trusted: restore the marker from a copy, or re-save the "
                                         "checkpoint")

    def _read_meta(self, key: str, expected: dict[str, int]) -> bytes:
        raw = self._read_meta_object(key)
        if self.committed and key not in expected:
            raise IntegrityError(f"{self.store.child(key)} is not covered by {mf.COMMIT_KEY}'s checksums: the "
                                 "checkpoint metadata is corrupt; restore it or re-save the checkpoint")
        if key in expected and crc32c(raw) != expected[key]:
            raise IntegrityError(f"checksum mismatch in {self.store.child(key)} (or in the checksum {mf.COMMIT_KEY} "
                                 "records for it): the checkpoint metadata is corrupt; restore it or re-save the "
                                 "checkpoint")
        return raw

    def _read_meta_object(self, key: str) -> bytes:
        """A metadata object's bytes. One that is gone, or is no regular object, makes the checkpoint
        unreadable as a whole, which the bare "is missing" of the storage layer did not say, nor what
        to do; other storage errors (a network failure) pass unchanged, as retrying may cure them."""
        try:
            return self.store.read(key)
        except BadObjectError as e:  # not `exists()` afterwards: fsspec answers False for any failure
            raise IntegrityError(f"{e}: the checkpoint metadata is incomplete; restore the object from a copy or "
                                 "re-save the checkpoint") from None

    def _table(self, path: str, expected: dict[str, int], shape: tuple[int, ...], dtype: type,
               *, compressed: bool = False) -> np.ndarray:
        """A metadata table whose shape the (verified) manifest implies: its document must be exactly
        the one the writer produces for that shape, and its chunk must match `COMMITTED`'s crc32c."""
        raw = self._table_bytes(path, expected, shape, dtype, compressed=compressed)
        if raw is None:
            return np.zeros(shape, dtype=dtype)
        return self._decode_table(path, raw, shape, dtype, compressed=compressed)

    def _table_bytes(self, path: str, expected: dict[str, int], shape: tuple[int, ...], dtype: type,
                     *, compressed: bool = False) -> bytes | None:
        """`_table`'s checks of the document and of the chunk's checksum, and the chunk's bytes (None
        for an empty table, which has no chunk)."""
        doc_key = f"{path}/zarr.json"
        if self._read_meta_object(doc_key) != mf.table_array_doc(shape, np.dtype(dtype), compressed=compressed):
            raise IntegrityError(f"{self.store.child(doc_key)} is not the document of a {list(shape)} "
                                 f"{np.dtype(dtype).name} table, as the manifest implies: the checkpoint "
                                 "metadata is corrupt; restore it or re-save the checkpoint")
        if not math.prod(shape):
            return None
        return self._read_meta(table_chunk_key(path, len(shape)), expected)

    def _decode_table(self, path: str, raw: bytes, shape: tuple[int, ...], dtype: type, *,
                      compressed: bool = False) -> np.ndarray:
        key = table_chunk_key(path, len(shape))
        try:
            return decode_table(raw, shape, np.dtype(dtype), compressed=compressed)
        except (ValueError, RuntimeError):  # undecodable zstd, or the wrong number of bytes
            raise IntegrityError(f"{self.store.child(key)} does not hold a {list(shape)} {np.dtype(dtype).name} "
                                 "table: the checkpoint metadata is corrupt; restore it or re-save the "
                                 "checkpoint") from None

    def _units_table(self, layout: int, shape: tuple[int, int]) -> np.ndarray | DeferredUnits:
        """Layout `layout`'s units table: decoded now when small, else checked (document, checksum,
        the size its zstd frame declares) and decoded on first use. Decoded, a (T, W) table can be
        gigabytes (8 GiB at 1,000 tensors x 1,048,576 ranks) that `info` or `ls` never look at."""
        path = f"meta/units/{layout}"
        raw = self._table_bytes(path, self._expected, shape, np.int64, compressed=True)
        if raw is None:
            return np.zeros(shape, dtype=np.int64)
        if math.prod(shape) * 8 <= EAGER_TABLE_BYTES:
            return self._decode_table(path, raw, shape, np.int64, compressed=True)
        declared = zstd_content_size(raw)
        if declared is not None and declared != math.prod(shape) * 8:  # also None for bytes that are no zstd
            raise IntegrityError(f"{self.store.child(table_chunk_key(path, 2))} does not hold a {list(shape)} int64 "
                                 f"table (it decodes to {declared:,} bytes): the checkpoint metadata is corrupt; "
                                 "restore it or re-save the checkpoint")
        if declared is None and bytes(raw[:4]) != ZSTD_MAGIC:
            raise IntegrityError(f"{self.store.child(table_chunk_key(path, 2))} does not hold a {list(shape)} int64 "
                                 "table (not zstd data): the checkpoint metadata is corrupt; restore it or re-save "
                                 "the checkpoint")

        def refuse(e: LayoutError) -> FormatError:
            return FormatError(f"{self.store.child(path)} describes an inconsistent layout ({mf.shorten(str(e), 160)}); "
                               "the checkpoint metadata is corrupt: restore it or re-save the checkpoint")

        return DeferredUnits(lambda: self._decode_table(path, raw, shape, np.int64, compressed=True), refuse)

    def _load_crc(self, bi: int) -> None:
        """Read buffer `bi`'s checksum table into `_crc` and `_crc_start` (its shape follows from the
        ranks' buffer sizes, which a deferred units table gives)."""
        self._require_committed()
        nb = mf.block_counts(self._rank_nbytes(bi), self.block_bytes)
        table = self._table(f"meta/crc/{bi}", self._expected, (int(nb.sum()),), np.uint32)
        dict.__setitem__(self._crc_start, bi, np.cumsum(nb) - nb)
        dict.__setitem__(self._crc, bi, table)

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def kind(self) -> str:
        return self.layout.kind

    @property
    def user(self) -> dict:
        return dict(self.manifest.get("user", {}))

    @property
    def created(self) -> dict:
        return dict(self.manifest.get("created", {}))

    def names(self) -> list[str]:
        return self.layout.names()

    def __contains__(self, name: str) -> bool:
        try:
            self.layout.locate(name)
            return True
        except KeyError:
            return False

    def meta(self, name: str) -> TensorMeta:
        bi, slot = self.layout.locate(name)
        spec = self.layout.buffers[bi]
        lay = self.layout.layout_of(bi)
        return TensorMeta(name, lay.shapes[slot], spec.dtype, spec.name, slot, lay)

    def _chunking(self, bi: int) -> mf.Chunking:
        """The chunk grid of buffer `bi`, computed once: a reshard asks for it on every range read."""
        ch = self._chunkings.get(bi)
        if ch is None:
            ch = self._chunkings[bi] = mf.buffer_chunking(self.layout, bi, self.max_chunk_bytes, self.block_bytes)
        return ch

    def _rank_nbytes(self, bi: int) -> np.ndarray:
        """(W,) bytes of every rank's buffer `bi`, computed once (O(W) each time otherwise)."""
        nb = self._nbytes.get(bi)
        if nb is None:
            nb = self.layout.rank_sizes(bi) * itemsize(self.layout.buffers[bi].dtype)
            nb.setflags(write=False)
            self._nbytes[bi] = nb
        return nb

    def _require_committed(self) -> None:
        if not self.committed:
            raise NotCommittedError(f"{self.url} is not committed: its data cannot be verified or read")

    # -- verified range reads ---------------------------------------------------------------------------
    def read_rank_ranges(self, buffer: int, reqs: Sequence[tuple[int, int, int]]) -> list[memoryview]:
        """Bytes `[start, stop)` of rank buffers `(rank, start, stop)`, checksum-verified."""
        self._require_committed()
        spec = self.layout.buffers[buffer]
        B = self.block_bytes
        nbytes = self._rank_nbytes(buffer)
        ch = self._chunking(buffer)
        fetch: list[tuple[str, int, int]] = []
        plan = []
        for rank, a, b in reqs:
            if b <= a:
                plan.append((rank, a, b, 0, 0, 0))
                continue
            if b > nbytes[rank]:
                raise IntegrityError(f"read past the end of buffer '{spec.name}' rank {rank}")
            lo, hi = (a // B) * B, min(-(-b // B) * B, int(nbytes[rank]))
            first = len(fetch)
            for j, pos, end in _object_spans(lo, hi, ch.chunk_bytes):
                fetch.append((mf.chunk_key(buffer, rank, j), pos - j * ch.chunk_bytes, end - j * ch.chunk_bytes))
            plan.append((rank, a, b, lo, first, len(fetch)))
        try:
            got = self.store.read_ranges(fetch)
        except BadObjectError as e:  # an outage or refused credentials pass as they are: nothing is damaged
            raise IntegrityError(f"buffer '{spec.name}': {e}; the checkpoint is incomplete or damaged — restore "
                                 "the object or re-save the checkpoint") from None
        out = []
        for rank, a, b, lo, f0, f1 in plan:
            if b <= a:
                out.append(memoryview(b""))
                continue
            data = got[f0] if f1 - f0 == 1 else b"".join(got[f0:f1])
            first_block = lo // B
            want = self._crc[buffer][self._crc_start[buffer][rank] + first_block:][: -(-len(data) // B)]
            have = block_crcs(data, B)
            if len(want) != len(have) or np.any(want != have):
                bad = int(np.nonzero(want != have)[0][0]) if len(want) == len(have) else 0
                raise self._mismatch(buffer, rank, first_block + bad)
            out.append(memoryview(data)[a - lo : b - lo])
        return out

    def _mismatch(self, bi: int, rank: int, block: int) -> IntegrityError:
        """The error for block `block` of rank `rank`'s buffer `bi` not matching its checksum."""
        key = mf.chunk_key(bi, rank, block * self.block_bytes // self._chunking(bi).chunk_bytes)
        return IntegrityError(f"checksum mismatch in {self.store.child(key)} (buffer '{self.layout.buffers[bi].name}', "
                              f"rank {rank}, block {block}): the object is corrupt; restore it or re-save the checkpoint")

    def block_length(self, bi: int, rank: int, block: int) -> int:
        """Bytes in checksum block `block` of rank `rank`'s buffer `bi` (the last one may be short)."""
        return min(self.block_bytes, int(self._rank_nbytes(bi)[rank]) - block * self.block_bytes)

    def check_block_crc(self, bi: int, rank: int, block: int, crc: int) -> None:
        """Raise IntegrityError unless `crc` is the stored crc32c of that block."""
        if crc != int(self._crc[bi][self._crc_start[bi][rank] + block]):
            raise self._mismatch(bi, rank, block)

    def read_pieces(self, bi: int, reqs: Sequence[tuple[int, int, Sequence[memoryview]]],
                    partial: PartialBlocks) -> None:
        """Bytes `[a, a + len(views))` of rank buffers `(rank, a, views)` into `views`, exactly: no
        widening to checksum blocks. Whole blocks in a range are verified as they land; the pieces of
        blocks it covers only in part go to `partial`, which verifies each block once its pieces
        cover it (`PartialBlocks.complete` reads what is left). For reads that would otherwise
        fetch the same block again and again for different destinations."""
        self._require_committed()
        spec = self.layout.buffers[bi]
        B = self.block_bytes
        chunk = self._chunking(bi).chunk_bytes
        sizes = self._rank_nbytes(bi)
        items = []  # (object key, offset in it, views): whole blocks, or one block's piece
        checks = []  # per crc the store yields: (rank, block, start in block, end in block)
        for rank, a, views in reqs:
            rest = [memoryview(v).cast("B") for v in views]
            end = a + sum(len(v) for v in rest)
            size = int(sizes[rank])
            if a < 0 or end > size:
                raise OutOfRangeError(f"buffer '{spec.name}' rank {rank}: read of [{a}, {end}) is outside its {size} bytes")
            whole_to = size if end == size else end // B * B  # whole blocks from a block start up to here
            pos = a
            while pos < end:
                k = pos // B
                stop = whole_to if pos == k * B and whole_to > pos else min(end, (k + 1) * B)
                part, rest = _take_bytes(rest, stop - pos)
                for j, p, e in _object_spans(pos, stop, chunk):  # whole blocks may span objects, pieces never
                    sub, part = _take_bytes(part, e - p)
                    items.append((mf.chunk_key(bi, rank, j), p - j * chunk, sub))
                    for blk in range(p // B, -(-e // B)):
                        checks.append((rank, blk, max(p, blk * B) - blk * B, min(e, (blk + 1) * B) - blk * B))
                pos = stop

        def check(k: int, have: int) -> None:
            rank, blk, lo, hi = checks[k]
            if lo == 0 and hi == self.block_length(bi, rank, blk):
                self.check_block_crc(bi, rank, blk, have)
            else:
                partial.add(bi, rank, blk, lo, hi, have)

        self._each_crc(bi, self.store.read_block_crcs(items, B), len(checks), check)

    def _each_crc(self, bi: int, got: Iterator[int], count: int, check: Callable[[int, int], None]) -> None:
        """`check(k, crc)` for each of the `count` crcs a store's `read_block_crcs` yields for a read of
        buffer `bi`: a damaged object is named as such, and a store that yields more or fewer crcs
        than the read has blocks cannot let one pass unchecked."""
        spec = self.layout.buffers[bi]
        seen = 0
        try:
            for k, have in enumerate(got):
                seen = k + 1
                if k == count:
                    break
                check(k, have)
        except BadObjectError as e:
            raise IntegrityError(f"buffer '{spec.name}': {e}; the checkpoint is incomplete or damaged — "
                                 "restore the object or re-save the checkpoint") from None
        finally:
            got.close()
        if seen != count:
            what = f"more than {count}" if seen > count else str(seen)
            raise StorageError(f"{type(self.store).__name__} checksummed {what} blocks of a read of buffer "
                               f"'{spec.name}' that covers {count}: a bug in that store; please report it")

    def read_rank(self, buffer: str | int, rank: int, start: int = 0, stop: int | None = None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
        """Elements `[start, stop)` of rank `rank`'s flat buffer (padding included). With `out`, block-
        aligned ranges (a whole rank buffer, say) are read straight into it and verified in place:
        the restart path of an engine that already holds its buffers."""
        bi = self._buffer_index(buffer)
        spec = self.layout.buffers[bi]
        isz = itemsize(spec.dtype)
        self._check_rank(rank)
        n = int(self.layout.rank_sizes(bi)[rank])
        stop = n if stop is None else stop
        _check_bounds(start, stop)
        if not 0 <= start <= stop <= n:
            raise OutOfRangeError(f"buffer '{spec.name}' rank {rank}: range [{start}, {stop}) is outside its {n} elements")
        if out is not None:
            if not isinstance(out, torch.Tensor) or out.device.type == "meta":
                raise TypeError(f"buffer '{spec.name}' rank {rank}: out must be a tensor with memory (on any device), "
                                f"got {'a meta tensor' if isinstance(out, torch.Tensor) else type(out).__name__}")
            if out.numel() != stop - start or out.dtype != torch_dtype(spec.dtype) or not out.is_contiguous():
                raise ValueError(f"buffer '{spec.name}' rank {rank}: out must be {stop - start} contiguous "
                                 f"{spec.dtype}")
        if stop == start:
            return out if out is not None else torch.empty(0, dtype=torch_dtype(spec.dtype), device="cpu")
        if out is None:
            (mv,) = self.read_rank_ranges(bi, [(rank, start * isz, stop * isz)])
            return _as_tensor(mv, spec.dtype)
        if not on_host(out):  # an engine's GPU buffer: a host window at a time, as ragckpt.load does
            unit = math.lcm(self.block_bytes, isz)  # windows of whole blocks: each block read once
            step = max(1, HOST_STAGING_BYTES // unit) * unit // isz
            fill_through_host(out, step, lambda lo, hi, host: self.read_rank(bi, rank, start + lo, start + hi, out=host),
                              offset=start)
            return out
        a, b = start * isz, stop * isz
        if a % self.block_bytes or (b % self.block_bytes and b != n * isz):
            (mv,) = self.read_rank_ranges(bi, [(rank, a, b)])
            as_bytes(out)[:] = mv
            return out
        self.read_blocks_into(bi, rank, a, as_bytes(out))
        return out

    def read_blocks_into(self, bi: int, rank: int, a: int, dst: memoryview) -> None:
        """Bytes [a, a+len(dst)) of rank `rank`'s buffer `bi`, read straight into `dst` and verified
        block by block as they land. `a` must start a checksum block and the range must end one (or
        end the rank's buffer): the restore path, and the resharder's block-aligned runs."""
        self.read_scatter(bi, rank, a, [dst])

    def read_scatter(self, bi: int, rank: int, a: int, views: Sequence[memoryview]) -> None:
        """Consecutive bytes of rank `rank`'s buffer `bi` from `a` into `views`, in order, verified
        block by block. `a` must start a checksum block and the views together must end one (or end
        the rank's buffer). On local files the kernel scatters the bytes straight into their places,
        so a reshard whose runs interleave (a tensor piece from each source rank, say) needs no
        staging buffer and no copy: the resharder passes its destination runs, with a scratch view
        for the bytes between them that it has no use for (they still count for the checksum)."""
        self.read_scatter_many(bi, [(rank, a, views)])

    def read_scatter_many(self, bi: int, reqs: Sequence[tuple[int, int, Sequence[memoryview]]]) -> None:
        """`read_scatter` of every `(rank, a, views)` of buffer `bi`, as one stream of reads: object
        stores keep the GETs of all of them in flight together (a load that reads a run from each of
        several source ranks, one after another, kept one GET in flight)."""
        self._require_committed()
        spec = self.layout.buffers[bi]
        ch = self._chunking(bi)
        B = self.block_bytes
        sizes = self._rank_nbytes(bi)
        items = []  # (object key, offset in it, views)
        blocks = []  # per request: (rank, first block, block count)
        for rank, a, views in reqs:
            views = [memoryview(v).cast("B") for v in views]
            end = a + sum(len(v) for v in views)
            size = int(sizes[rank])
            if end > size:
                raise OutOfRangeError(f"buffer '{spec.name}' rank {rank}: read_scatter of [{a}, {end}) runs past its "
                                      f"{size} bytes")
            if a % B or (end % B and end != size):
                raise ValueError(f"buffer '{spec.name}' rank {rank}: read_scatter of [{a}, {end}) is not whole blocks")
            for j, pos, stop in _object_spans(a, end, ch.chunk_bytes):  # objects hold whole blocks
                part, views = _take_bytes(views, stop - pos)
                items.append((mf.chunk_key(bi, rank, j), pos - j * ch.chunk_bytes, part))
            blocks.append((rank, a // B, -(-(end - a) // B)))
        crc, start = self._crc[bi], self._crc_start[bi]
        want = np.concatenate([crc[start[r] + f : start[r] + f + n] for r, f, n in blocks]).tolist() if blocks else []

        def check(k: int, have: int) -> None:
            if have != want[k]:
                i = 0
                while k >= blocks[i][2]:
                    k -= blocks[i][2]
                    i += 1
                raise self._mismatch(bi, blocks[i][0], blocks[i][1] + k)

        self._each_crc(bi, self.store.read_block_crcs(items, B), len(want), check)

    def read_flat(self, name: str, start: int = 0, stop: int | None = None, out: torch.Tensor | None = None, *,
                  partial: PartialBlocks | None = None) -> torch.Tensor:
        """Flat elements `[start, stop)` of tensor `name` as a 1-D tensor (into `out` if given). Code
        that reads a tensor window by window should pass the same `out` every time: a fresh result
        per window is freed into the thread's malloc arena, which keeps it (reading 64 MiB in 4 MiB
        windows peaked 38 MiB above the interpreter, 15 when glibc was made to unmap such blocks).
        With `partial`, the checksum blocks the range only cuts are read in part, not whole, on local
        files (`read_pieces`): a caller reading many neighbouring ranges (every tensor of a state
        dict) reads each byte once, and must call `partial.complete()` before trusting them."""
        bi, slot = self.layout.locate(name)
        spec = self.layout.buffers[bi]
        lay = self.layout.layout_of(bi)
        n = int(lay.numels[slot])
        stop = n if stop is None else stop
        _check_bounds(start, stop)
        if not 0 <= start <= stop <= n:
            raise OutOfRangeError(f"tensor '{name}': range [{start}, {stop}) is outside its {n} elements")
        dt = torch_dtype(spec.dtype)
        if out is None:
            out = torch.empty(stop - start, dtype=dt, device="cpu")
        elif not isinstance(out, torch.Tensor) or out.device.type == "meta":
            raise TypeError(f"tensor '{name}': out must be a tensor with memory (on any device), got "
                            f"{'a meta tensor' if isinstance(out, torch.Tensor) else type(out).__name__}")
        elif out.numel() != stop - start or out.dtype != dt:
            raise ValueError(f"tensor '{name}': out must be {stop - start} elements of {dt}")
        elif out.dim() != 1:
            if not out.is_contiguous():
                raise ValueError(f"tensor '{name}': out must be 1-D or contiguous (it is filled in flat order)")
            out = out.view(-1)
        if stop == start:
            return out
        if out.is_contiguous() and not on_host(out):  # a GPU tensor: a host window at a time
            fill_through_host(out, max(1, HOST_STAGING_BYTES // itemsize(spec.dtype)),
                              lambda lo, hi, host: self.read_flat(name, start + lo, start + hi, out=host,
                                                                  partial=partial))
            return out
        seg = lay.segments().for_slot(slot)
        i0 = max(0, int(np.searchsorted(seg.flat_start, start, side="right")) - 1)
        i1 = int(np.searchsorted(seg.flat_start, stop, side="left"))
        seg = seg.select(slice(i0, i1))
        a = np.maximum(seg.flat_start, start)
        b = np.minimum(seg.flat_start + seg.length, stop)
        keep = b > a
        a, b, seg = a[keep], b[keep], seg.select(keep)
        isz = itemsize(spec.dtype)
        boff = seg.offset + (a - seg.flat_start)
        reqs = list(zip(seg.rank.tolist(), (boff * isz).tolist(), ((boff + b - a) * isz).tolist(), strict=True))
        pos = a - start
        in_place = out.is_contiguous() and on_host(out)
        large = (stop - start) * isz >= READ_IN_PLACE_MIN_BYTES
        if in_place and (self.store.zero_copy_reads or (large and self.store.concurrent_reads)):
            dst, dst_pos = as_bytes(out), (pos * isz).tolist()
            exact = partial if self.store.zero_copy_reads else None
            if large:
                self._read_ranges_in_place(bi, reqs, dst_pos, dst, exact)
            elif exact is not None:
                self.read_pieces(bi, [(rank, ra, [dst[d : d + rb - ra]]) for (rank, ra, rb), d in
                                      zip(reqs, dst_pos, strict=True)], exact)
            else:  # small, on local files
                for (rank, ra, rb), d in zip(reqs, dst_pos, strict=True):
                    self._scatter_range(bi, rank, ra, rb, dst[d : d + rb - ra])
            return out
        # one request per storage object: a range over two would be joined into one more copy of it
        reqs, dst_pos = _split_at_objects(reqs, (pos * isz).tolist(), self._chunking(bi).chunk_bytes)
        parts = self.read_rank_ranges(bi, reqs)
        for mv, p in zip(parts, dst_pos, strict=True):
            piece = _as_tensor(mv, spec.dtype)
            copy_runs(out, [p // isz], piece, [0], [piece.numel()])
        return out

    def _read_ranges_in_place(self, bi: int, reqs: list[tuple[int, int, int]], dst_pos: list[int],
                              dst: memoryview, exact: PartialBlocks | None = None) -> None:
        """Rank-buffer byte ranges `(rank, a, b)` into `dst` at `dst_pos`: the whole checksum blocks
        inside each range are read straight into place and verified as they land, in parallel spans;
        only the partial blocks at the ends go through `read_rank_ranges` and a copy. A large tensor
        read then costs one copy per byte, not a read into fresh memory, a checksum pass over it from
        DRAM and a second copy. On object stores the whole blocks of every range go to one
        `read_scatter_many` (its GETs in flight together, streaming into place: a tensor read from
        S3 no longer holds a second copy of itself), the partial ends to one `read_rank_ranges`. With
        `exact` (local files), the partial ends are read in part (`read_pieces`), not whole."""
        B = self.block_bytes
        step = max(B, (_IN_PLACE_SPAN_BYTES // B) * B)
        nbytes = self._rank_nbytes(bi)
        spans: list[tuple[int, int, int, int]] = []  # (rank, a, b, dst offset), block-aligned
        partial: list[tuple[int, int, int]] = []
        partial_pos: list[int] = []
        for (rank, a, b), d in zip(reqs, dst_pos, strict=True):
            ia = -(-a // B) * B
            ib = b if b == int(nbytes[rank]) else (b // B) * B
            if ia >= ib:
                partial.append((rank, a, b))
                partial_pos.append(d)
                continue
            for lo, hi in ((a, ia), (ib, b)):
                if hi > lo:
                    partial.append((rank, lo, hi))
                    partial_pos.append(d + lo - a)
            spans.extend((rank, s, min(ib, s + step), d + s - a) for s in range(ia, ib, step))

        if self.store.concurrent_reads:
            self.read_scatter_many(bi, [(rank, lo, [dst[d : d + hi - lo]]) for rank, lo, hi, d in spans])
            for (_, a, b), d, mv in zip(partial, partial_pos, self.read_rank_ranges(bi, partial), strict=True):
                dst[d : d + b - a] = mv
            return

        def one(span: tuple[int, int, int, int]) -> None:
            rank, lo, hi, d = span
            self.read_blocks_into(bi, rank, lo, dst[d : d + hi - lo])

        if len(spans) > 1:
            with ThreadPoolExecutor(min(len(spans), default_workers())) as ex:
                list(ex.map(one, spans))
        elif spans:
            one(spans[0])
        if exact is not None:
            self.read_pieces(bi, [(rank, a, [dst[d : d + b - a]]) for (rank, a, b), d in
                                  zip(partial, partial_pos, strict=True)], exact)
            return
        for (rank, a, b), d in zip(partial, partial_pos, strict=True):
            self._scatter_range(bi, rank, a, b, dst[d : d + b - a])

    def _scatter_range(self, bi: int, rank: int, a: int, b: int, dst: memoryview) -> None:
        """Bytes `[a, b)` of a rank buffer into `dst` with `read_scatter`: the parts of the checksum
        blocks at either end that lie outside the range go to this thread's scratch (read for the
        checksum only), the rest straight into place. A fresh staging buffer per read instead was
        kept by the thread's malloc arena: `diff` peaked 17 MiB over its window with 4 threads."""
        B = self.block_bytes
        lo = (a // B) * B
        hi = min(-(-b // B) * B, int(self._rank_nbytes(bi)[rank]))
        scratch = self._scratch.take((a - lo) + (hi - b))
        self.read_scatter(bi, rank, lo, [scratch[: a - lo].data, dst, scratch[a - lo :].data])

    def read(self, name: str) -> torch.Tensor:
        """The whole tensor, in its global shape and logical dtype."""
        m = self.meta(name)
        return self.read_flat(name).reshape(m.shape)

    def read_local(self, name: str, rank: int) -> torch.Tensor:
        """Rank `rank`'s piece of `name` as the RaggedShard placement defines it: a 1-D tensor of its
        contiguous flat element range (empty when the rank holds no units)."""
        m = self.meta(name)
        self._check_rank(rank)
        start, stop = m.placement.ranges(m.shape)[rank]
        return self.read_flat(name, int(start), int(stop))

    def _buffer_index(self, buffer: object) -> int:
        """A buffer given by name or by index, checked (a bad index read "missing" objects and
        called a healthy checkpoint damaged)."""
        if isinstance(buffer, str):
            return self.layout.buffer_index(buffer)
        names = [b.name for b in self.layout.buffers]
        if isinstance(buffer, bool) or not isinstance(buffer, (int, np.integer)) or not 0 <= buffer < len(names):
            raise OutOfRangeError(f"buffer {buffer!r} is neither the name nor the index (0..{len(names) - 1}) of one of "
                                  f"this checkpoint's buffers {names}")
        return int(buffer)

    def _check_rank(self, rank: object) -> None:
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < self.world_size:
            raise OutOfRangeError(f"rank {rank!r} is outside this checkpoint's world of {self.world_size} ranks "
                                  f"(0..{self.world_size - 1})")

    def extra(self, rank: int) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """Per-rank extra tensors and string metadata saved with `save_shard(extra=...)`."""
        raw = self.extra_bytes(rank)
        if raw is None:
            return {}, {}
        from safetensors.torch import load  # loads torch: only a checkpoint with extras needs it

        try:  # checksum-verified, so only a forged or mis-saved object gets here
            header_len = int.from_bytes(raw[:8], "little")
            header = mf.parse_json(raw[8 : 8 + header_len])
            meta = (header.get("__metadata__") if isinstance(header, dict) else None) or {}
            return load(raw), dict(meta)
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
            raise IntegrityError(f"{self.store.child(mf.extra_key(rank))} (extras of rank {rank}) is not a "
                                 f"safetensors file ({type(e).__name__}); re-save that rank's extras") from None

    def extra_bytes(self, rank: int) -> bytes | None:
        """The stored extras object of `rank` (a safetensors file), checksum-verified; None when
        that rank saved none. For copying extras unchanged (a reshard at the same world size)."""
        self._require_committed()
        self._check_rank(rank)
        nb, crc = (int(x) for x in self._extra[rank])
        if nb < 0:
            return None
        raw = self.store.read(mf.extra_key(rank))
        if len(raw) != nb or crc32c(raw) != crc:
            raise IntegrityError(f"{self.store.child(mf.extra_key(rank))} is corrupt or truncated (rank {rank})")
        return raw

    def ranks_with_extras(self) -> int:
        """How many ranks saved extras."""
        self._require_committed()
        return int((self._extra[:, 0] >= 0).sum())

    # -- full verification ---------------------------------------------------------------------------------
    def verify_bytes(self) -> int:
        """The bytes `verify` reads from buffer chunks, and reports to its `progress` callback: every
        rank's chunks whole, their edge padding included (more than `layout.total_bytes()`)."""
        total = 0
        for bi in range(len(self.layout.buffers)):
            ch = self._chunking(bi)
            total += int(ch.counts(self.layout.rank_sizes(bi)).sum()) * ch.chunk_bytes
        return total

    def _group_keys(self) -> list[str]:
        """The group documents a plain zarr reader walks through to this checkpoint's arrays."""
        keys = [mf.ROOT_META_KEY, "buffers/zarr.json", "meta/zarr.json"]
        if any("units" in e for e in self.manifest["layouts"]):
            keys.append("meta/units/zarr.json")
        if self.layout.buffers:
            keys.append("meta/crc/zarr.json")
        return keys

    def _document_problems(self, listed_records: set[str]) -> tuple[int, list[str]]:
        """`verify`'s check of the group documents and of every rank's record (`listed_records`: the
        record keys the store lists): how many objects it checked, and one line per bad one."""
        problems, objects = [], 0
        why = documents.marker_problem(self.marker)
        if why is not None:
            problems.append(f"{self.store.child(mf.COMMIT_KEY)}: {why}; restore the marker from a copy, or re-save "
                            "the checkpoint")
        for key in self._group_keys():
            objects += key != mf.ROOT_META_KEY  # the root is counted with the checksummed metadata
            try:
                why = documents.group_doc_problem(self.store.read(key))
                what = f"{self.store.child(key)}: {why}" if why else None
            except BadObjectError as e:
                what = str(e)
            if what is not None:
                problems.append(f"{what}; plain zarr readers cannot walk the checkpoint's groups without it: restore "
                                f"it (a group document is {documents.GROUP_DOC_TEXT}) or re-save the checkpoint")
        tables = {i: self.layout.layouts[i].units for i, e in enumerate(self.manifest["layouts"]) if "units" in e}
        fingerprint = mf.layout_fingerprint(self.manifest, tables)
        save_id = self.manifest.get("save_id")
        B = self.block_bytes
        ranks = range(self.world_size)
        for lo in range(0, self.world_size, _RECORDS_PER_BATCH):
            batch = ranks[lo : lo + _RECORDS_PER_BATCH]
            keys = [mf.rank_manifest_key(r) for r in batch]
            present = [k for k in keys if k in listed_records]
            try:
                got = dict(zip(present, self.store.read_many(present), strict=True))
            except BadObjectError:  # one of them is no regular object: read them one by one
                got = {}
                for k in present:
                    try:
                        got[k] = self.store.read(k)
                    except BadObjectError as e:
                        problems.append(f"{e} (the record of rank {int(k[6:-5])}; restore it from a copy, or re-save "
                                        "the checkpoint)")
            for r, key in zip(batch, keys, strict=True):
                objects += 1
                if key not in got:
                    if key not in present:
                        problems.append(f"{self.store.child(key)}: missing (the record of rank {r}; restore it from "
                                        "a copy, or re-save the checkpoint)")
                    continue
                want = documents.RankExpectation(
                    r, fingerprint, save_id,
                    [(int(nb[r]), self._crc[bi][self._crc_start[bi][r]:][: -(-int(nb[r]) // B)].tolist())
                     for bi, nb in enumerate(self._rank_nbytes(b) for b in range(len(self.layout.buffers)))],
                    None if int(self._extra[r][0]) < 0 else (int(self._extra[r][0]), int(self._extra[r][1])))
                why = documents.rank_record_problem(got[key], want)
                if why is not None:
                    problems.append(f"{self.store.child(key)}: {why} (the record of rank {r}, which the commit "
                                    "checked; restore it from a copy, or re-save the checkpoint)")
        return objects, problems

    def verify(self, *, workers: int | None = None, progress: Callable[[int], None] | None = None,
               memory_bytes: int = DEFAULT_MEMORY_BYTES) -> VerifyReport:
        """Check every stored object: sizes, block checksums, edge padding, the array and group
        documents a plain zarr reader walks, the ranks' records, extras, the marker's fields.
        `progress` gets the expected size of each buffer chunk once it is checked (or found bad), so
        its calls add up to `verify_bytes()`. About `memory_bytes` of object data is held at once,
        across all `workers` threads (at least one checksum block per thread)."""
        memory_bytes = check_memory_budget(memory_bytes)
        self._require_committed()
        report = VerifyReport()
        B = self.block_bytes
        n_buffers = len(self.layout.buffers)
        rank_nbytes = [self._rank_nbytes(bi) for bi in range(n_buffers)]
        chunkings = [self._chunking(bi) for bi in range(n_buffers)]

        # objects are streamed through one reused buffer per thread, at most `fetch_bytes` at a time, so
        # memory stays at threads x span however large the objects are; the span shrinks to keep that
        # within the budget (on S3, fetch_bytes is two 32 MiB parts: 16 threads held 1 GiB)
        threads = workers or default_workers()
        span = max(B, (min(self.store.fetch_bytes, memory_bytes // threads) // B) * B)
        local = threading.local()

        def check_object(key: str, size: int, real: int, want: list[int]) -> str | None:
            buf = getattr(local, "buf", None)
            if buf is None:
                buf = local.buf = memoryview(np.empty(span, dtype=np.uint8))
            pos, i = 0, 0
            for s in range(0, size, span):
                for piece in self.store.read_range_pieces(key, s, buf[: min(span, size - s)], B):
                    data = max(0, min(len(piece), real - pos))  # the rest is edge padding
                    if data:
                        if crc32c(piece[:data]) != want[i]:
                            return "checksum mismatch"
                        i += 1
                    if data < len(piece) and np.frombuffer(piece[data:], dtype=np.uint8).any():
                        return "non-zero bytes in the edge padding"
                    pos += len(piece)
            return None

        # one listing gives every chunk's size: on object stores a HEAD per object cost thousands of
        # requests at 8,192 ranks
        all_chunks = self.store.list_sizes("buffers")
        listed: list[dict[str, int]] = [{} for _ in range(n_buffers)]
        for key, size in all_chunks.items():
            b = key.split("/", 2)[1]
            if b.isdigit() and int(b) < n_buffers:
                listed[int(b)][key] = size
        others = [*self.store.list("extra"), *self.store.list("ranks"), *self.store.list("meta")]
        units = [i for i, e in enumerate(self.manifest["layouts"]) if "units" in e]
        for key in mf.stray_objects([*all_chunks, *others], self.layout, self.max_chunk_bytes, B, self._extra[:, 0],
                                    units_layouts=units):
            report.problems.append(f"{self.store.child(key)}: not part of this checkpoint (left by an earlier save "
                                   "attempt; plain zarr readers would see it); delete it")

        def check_rank(bi: int, rank: int) -> tuple[int, int, list[str]]:
            spec = self.layout.buffers[bi]
            nbytes = int(rank_nbytes[bi][rank])
            ch = chunkings[bi]
            problems, objs, done = [], 0, 0
            crcs = self._crc[bi][self._crc_start[bi][rank]:][: -(-nbytes // B)].tolist()
            for j in range(ch.count(nbytes // ch.itemsize)):
                key = mf.chunk_key(bi, rank, j)
                where = f"buffer '{spec.name}', rank {rank}"
                try:
                    size = listed[bi].get(key)
                    if size != ch.chunk_bytes and (size is None or size == UNREADABLE
                                                   or self.store.object_problem(key) is not None):
                        raise BadObjectError(self.store.size_problem(key, size, ch.chunk_bytes))
                    objs += 1
                    if size != ch.chunk_bytes:
                        problems.append(f"{self.store.child(key)}: {size} bytes, expected {ch.chunk_bytes} "
                                        f"(truncated or overwritten; {where})")
                        continue
                    lo = j * ch.chunk_bytes
                    bad = check_object(key, size, min(size, nbytes - lo), crcs[lo // B :])
                except BadObjectError as e:  # damage; a store that fails to answer fails the verify instead
                    problems.append(f"{e} ({where})")
                    continue
                finally:
                    if progress:  # the object is done with, good or bad: the bar ends at verify_bytes()
                        progress(ch.chunk_bytes)
                if bad:
                    problems.append(f"{self.store.child(key)}: {bad} ({where})")
                done += size
            return objs, done, problems

        objs, problems = self._document_problems({k for k in others if k.startswith("ranks/")})
        report.objects += objs
        report.problems.extend(problems)
        for bi, spec in enumerate(self.layout.buffers):
            key = f"{mf.buffer_key(bi)}/zarr.json"
            smax = int(self.layout.rank_sizes(bi).max())
            report.objects += 1
            try:
                if self.store.read(key) != mf.buffer_array_doc(spec, self.world_size, smax, self._chunking(bi)):
                    report.problems.append(f"{self.store.child(key)}: array document does not match the checkpoint "
                                            "metadata (plain zarr readers would misread this buffer)")
            except BadObjectError as e:
                report.problems.append(str(e))
        tasks = [(bi, r) for bi in range(len(self.layout.buffers)) for r in range(self.world_size)]
        with ThreadPoolExecutor(threads) as ex:
            for objs, nb, probs in bounded_map(lambda t: ex.submit(check_rank, *t), tasks, threads):
                report.objects += objs
                report.bytes += nb
                report.problems.extend(probs)
        for r in range(self.world_size):
            if int(self._extra[r][0]) >= 0:
                report.objects += 1
                try:
                    self.extra(r)
                    report.bytes += int(self._extra[r][0])  # checked bytes count, as for the buffers
                except (IntegrityError, BadObjectError) as e:
                    report.problems.append(str(e))
        report.objects += len(self._expected) + 1
        return report


#: rank records read at once by `verify` (a few hundred bytes each)
_RECORDS_PER_BATCH = 4096


#: host memory through which a buffer on another device (a GPU) is filled, a window at a time
#: (`read_rank(out=)`, `read_flat(out=)`, `ragckpt.load`), so host memory does not grow with the
#: buffer: an engine's fp32 state can be tens of GB per rank
HOST_STAGING_BYTES = 64 << 20


def on_host(t: torch.Tensor) -> bool:
    """Whether reads can land in `t` itself rather than in a host window copied over to it."""
    return t.device.type == "cpu"


def fill_through_host(out: torch.Tensor, step: int, read: Callable[[int, int, torch.Tensor], None],
                      offset: int = 0) -> None:
    """Fill contiguous `out` (on a device) one host window of at most `step` elements at a time:
    `read(lo, hi, host)` fills `host` with flat elements `[lo, hi)`, which are then copied over.
    Windows end where `offset + position` is a multiple of `step`, so they can follow a grid of
    the source (its checksum blocks) when `out` starts off it."""
    flat = out.reshape(-1)
    n = flat.numel()
    host = torch.empty(min(n, step), dtype=flat.dtype, device="cpu")  # not the default device: a window on
    # the GPU (torch.set_default_device, a `with torch.device(...)` block) would be sent back here forever
    lo = 0
    while lo < n:
        hi = min(n, (lo + offset) // step * step + step - offset)
        read(lo, hi, host[: hi - lo])
        copy_bits(flat[lo:hi], host[: hi - lo])
        lo = hi


#: a `read_flat` this large reads its whole checksum blocks in place (see `_read_ranges_in_place`);
#: smaller ones are cheaper as one batched staged read
READ_IN_PLACE_MIN_BYTES = 8 << 20
#: in-place reads are split into spans of this size so that several threads share one long range
_IN_PLACE_SPAN_BYTES = 32 << 20


def _take_bytes(views: list[memoryview], n: int) -> tuple[list[memoryview], list[memoryview]]:
    """The first `n` bytes of consecutive `views` (cut where needed), and the views after them."""
    head: list[memoryview] = []
    i = 0
    while n > 0:
        v = views[i]
        if len(v) > n:
            head.append(v[:n])
            return head, [v[n:], *views[i + 1 :]]
        head.append(v)
        n -= len(v)
        i += 1
    return head, views[i:]


def _object_spans(lo: int, hi: int, object_bytes: int) -> Iterator[tuple[int, int, int]]:
    """`(object index, start, stop)` of the pieces of rank-buffer bytes `[lo, hi)` that each lie in
    one storage object (objects hold `object_bytes` each)."""
    pos = lo
    while pos < hi:
        j = pos // object_bytes
        stop = min(hi, (j + 1) * object_bytes)
        yield j, pos, stop
        pos = stop


def _split_at_objects(reqs: list[tuple[int, int, int]], dst_pos: list[int],
                      object_bytes: int) -> tuple[list[tuple[int, int, int]], list[int]]:
    """Byte ranges `(rank, a, b)` (landing at `dst_pos`) cut where a rank's storage objects meet;
    an empty range stays as it is."""
    out, pos = [], []
    for (rank, a, b), d in zip(reqs, dst_pos, strict=True):
        for _, s, e in _object_spans(a, b, object_bytes) if b > a else [(0, a, b)]:
            out.append((rank, s, e))
            pos.append(d + s - a)
    return out, pos


def _check_bounds(start: object, stop: object) -> None:
    """Element bounds are integers: a float would reach torch or numpy as a raw TypeError, or cut
    a range at a truncated index."""
    for what, v in (("start", start), ("stop", stop)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise TypeError(f"{what} must be an integer element index, got {v!r}")


def _as_tensor(mv: memoryview, dtype: str) -> torch.Tensor:
    return from_bytes(mv, dtype)


def open(url: str, *, storage_options: dict | None = None, allow_uncommitted: bool = False) -> Checkpoint:  # noqa: A001
    """Open a committed checkpoint for reading (`allow_uncommitted=True` for metadata-only inspection)."""
    return Checkpoint(url, storage_options=storage_options, allow_uncommitted=allow_uncommitted)

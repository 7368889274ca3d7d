"""A DCP checkpoint opened for streaming reads without a process group: its `.metadata` validated
up front (every chunk, storage entry and data file), then the exact bytes of the chunks that
overlap a flat element range read from local files or through ragckpt's stores."""

from __future__ import annotations

import os
import re
import stat
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np

from ragckpt.checkpoint.writer import default_workers
from ragckpt.convert.dcp.chunks import DcpChunk, DcpTensor, _box_runs, _check_tiling, _dims, _is_int, _shown
from ragckpt.convert.dcp.record import ExportRecord, read_export_record
from ragckpt.convert.dcp_format import (
    METADATA_FILE,
    WHOLE_RECORD_BYTES,
    ByteSource,
    FdSource,
    PrefetchedSource,
    StoreSource,
    TensorRecord,
    coalesce_ranges,
    load_metadata,
    parse_metadata,
    parse_tensor_record,
    read_record_elements,
    read_record_elements_into,
    record_header_ranges,
)
from ragckpt.errors import FormatError
from ragckpt.format.dtypes import dtype_name, torch_dtype
from ragckpt.format.intervals import flat_range_to_boxes
from ragckpt.format.runs import copy_runs
from ragckpt.storage.store import Buffer, LocalStore, open_store

if TYPE_CHECKING:
    import torch
else:  # the CLI imports this module for its commands; torch comes in when one runs (see ragckpt.lazy)
    from ragckpt.lazy import torch

_RANK_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")
_FD_CACHE_MAX = 256
# object-store sources: record headers are fetched this many records per batch (at most
# 2 x 4 KiB or 16 KiB each, so a batch holds a few MiB), nearby windows merged when at most
# _COALESCE_GAP_BYTES apart into requests of at most _COALESCE_MAX_BYTES; small records fetched whole
# are kept for their element reads up to _WHOLE_CACHE_BYTES in all
_HEADER_BATCH = 1024
_COALESCE_GAP_BYTES = 16 << 10
_COALESCE_MAX_BYTES = 4 << 20
_WHOLE_CACHE_BYTES = 64 << 20


class DcpCheckpoint:
    """A DCP checkpoint opened for streaming reads (no process group needed): a local directory, or
    a prefix on any store ragckpt supports (`s3://bucket/prefix`, `memory://...`, `file://...`).

    Local files are read with `os.pread`/`os.preadv` on cached descriptors (the fast path). On an
    object store every read is a request, so the checkpoint is listed once (sizes included), record
    headers and non-tensor entries are fetched in a few coalesced, concurrent range requests, and
    small records are kept whole so their elements need no request of their own."""

    def __init__(self, directory: str, storage_options: dict | None = None):
        self.store = open_store(directory, storage_options)
        #: object sizes from one listing (object stores); None for a local directory, whose files
        #: are stat'ed and read through descriptors
        self._sizes: dict[str, int] | None = None
        if isinstance(self.store, LocalStore):
            self.directory = self.store.root
            md = load_metadata(self.directory)
        else:
            self.directory = self.store.url
            self._sizes = self.store.list_sizes()
            md = self._remote_metadata()
        self.metadata = md
        # loads torch: imported by the import that needs it, not with the CLI
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

        where = self._where(METADATA_FILE)
        storage: dict[tuple[str, tuple[int, ...] | None], Any] = {}
        for idx, info in md.storage_data.items():
            off = None if getattr(idx, "offset", None) is None else tuple(int(x) for x in idx.offset)
            storage[(idx.fqn, off)] = info
        self.tensors: dict[str, DcpTensor] = {}
        self.bytes_entries: dict[str, Any] = {}
        for key, sm in md.state_dict_metadata.items():
            if not isinstance(key, str):
                raise FormatError(f"{where}: holds the key {_shown(key)}, which is not a string; the metadata is "
                                  "corrupt")
            if isinstance(sm, TensorStorageMetadata):
                torch_dt = getattr(getattr(sm, "properties", None), "dtype", None)
                if not isinstance(torch_dt, torch.dtype):
                    raise FormatError(f"{where}: tensor '{key}' has dtype {_shown(torch_dt)}, not a torch dtype; "
                                      "the metadata is corrupt")
                try:
                    dt = dtype_name(torch_dt)
                except FormatError:
                    raise FormatError(f"tensor '{key}' has dtype {torch_dt}, which ragckpt does not "
                                      "store; convert it before importing") from None
                shape = _dims(getattr(sm, "size", None))
                if shape is None:
                    raise FormatError(f"{where}: tensor '{key}' has size {_shown(getattr(sm, 'size', None))}, not "
                                      "a shape of non-negative integers under 2**62; the metadata is corrupt")
                chunks = []
                for c in sm.chunks if isinstance(sm.chunks, list | tuple) else [sm.chunks]:
                    offs = _dims(getattr(c, "offsets", None), len(shape))
                    sizes = _dims(getattr(c, "sizes", None), len(shape))
                    if offs is None or sizes is None:
                        got = (f"offsets {_shown(getattr(c, 'offsets', None))} and sizes "
                               f"{_shown(getattr(c, 'sizes', None))}" if c is not None else "None")
                        raise FormatError(f"{where}: tensor '{key}' of shape {list(shape)} lists a chunk with {got}, "
                                          f"not {len(shape)} non-negative offsets and sizes; the metadata is corrupt")
                    info = storage.get((key, offs))
                    if info is None:
                        raise FormatError(f"{where}: no storage entry for chunk {offs} of tensor '{key}'; "
                                          "the metadata is incomplete")
                    self._check_info(key, info)
                    chunks.append(DcpChunk(offs, sizes, info.relative_path, int(info.offset), int(info.length)))
                t = DcpTensor(key, shape, dt, chunks)
                _check_tiling(t, where)
                self.tensors[key] = t
            elif isinstance(sm, BytesStorageMetadata):
                info = storage.get((key, None))
                if info is None:
                    raise FormatError(f"{where}: no storage entry for non-tensor entry '{key}'")
                self._check_info(key, info)
                self.bytes_entries[key] = info
            else:
                raise FormatError(f"{where}: entry '{key}' has unknown storage type {type(sm).__name__}")
        self._check_files()
        self._records: dict[tuple[str, int], TensorRecord] = {}
        self._lock = threading.Lock()
        self._fds: dict[str, FdSource] = {}  # local files: open descriptors, by path
        #: small records fetched whole during the header pass (object stores): (path, start) -> bytes
        self._whole: dict[tuple[str, int], bytes] = {}
        self._whole_bytes = 0

    def _where(self, path: str) -> str:
        """The path or URL of one file of the checkpoint, for messages."""
        return self.store.child(path)

    def _remote_metadata(self) -> Any:
        """`.metadata` of an object-store checkpoint, from the listing already made: a missing one is
        reported with its URL (after making sure the bucket itself exists, so a typo in the bucket
        name is not called "no checkpoint here")."""
        assert self._sizes is not None
        child = self._where(METADATA_FILE)
        if METADATA_FILE not in self._sizes:
            if not self._sizes:
                self.store.check_root()
            empty = "; nothing is stored under that prefix" if not self._sizes else ""
            raise FormatError(f"{self.directory} is not a PyTorch DCP checkpoint: it has no {METADATA_FILE} object "
                              f"({child} is missing{empty})")
        return parse_metadata(self.store.read(METADATA_FILE), child)

    def _check_info(self, key: str, info: Any) -> None:
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not (_is_int(offset) and _is_int(length) and 0 <= offset < 2**63 and 0 <= length < 2**63):
            raise FormatError(f"{self._where(METADATA_FILE)}: entry '{key}' is stored at offset {_shown(offset)}, "
                              f"length {_shown(length)}, not non-negative integers; the metadata is corrupt")
        if getattr(info, "transform_descriptors", None):
            raise FormatError(f"entry '{key}' is stored through stream transforms {list(info.transform_descriptors)} "
                              "(e.g. compression); import-dcp reads only plain DCP files")

    def _check_files(self) -> None:
        """Every referenced byte range must exist: catches missing rank files and truncation up front,
        before a single byte of the destination is written. Local files are stat'ed; objects are
        looked up in the listing (no request per object)."""
        need: dict[str, tuple[int, str]] = {}
        ranges = [(i.relative_path, int(i.offset) + int(i.length), idx.fqn)
                  for idx, i in self.metadata.storage_data.items()]  # empty chunks too: damage is damage
        for path, end, key in ranges:
            if end > need.get(path, (-1, ""))[0]:
                need[path] = (end, key)
        for path, (end, key) in need.items():
            if not isinstance(path, str) or os.path.basename(path) != path or path in ("", ".", ".."):
                raise FormatError(f"{self.directory}: entry '{key}' points outside the checkpoint ({path!r})")
            full = self._where(path)
            size = self._file_size(path, full, key)
            if size < end:
                raise FormatError(f"{full} is truncated: {size} bytes, but entry '{key}' needs {end}")

    def _file_size(self, path: str, full: str, key: str) -> int:
        """Size of data file `path` (`full`: its path or URL); one-line errors when it is missing or
        not a plain file (a directory, or on an object store a prefix of other objects)."""
        kind = None
        if self._sizes is not None:
            size = self._sizes.get(path)
            if size is not None:
                return size
            if any(k.startswith(path + "/") for k in self._sizes):
                kind = "a prefix of other objects, not an object"
        else:
            try:
                st = os.stat(full)
            except FileNotFoundError:
                st = None
            if st is not None:
                if stat.S_ISREG(st.st_mode):
                    return st.st_size
                kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
        if kind is not None:
            raise FormatError(f"{full} is {kind}, where entry '{key}' expects a DCP data file; the DCP "
                              "checkpoint is damaged")
        m = _RANK_FILE.match(path)
        who = f" (written by rank {m.group(1)} of the save)" if m else ""
        raise FormatError(f"{full} is missing{who}; the DCP checkpoint is incomplete")

    @property
    def saved_world_size(self) -> int | None:
        """World size of the save, recovered from DCP's `__<rank>_<n>.distcp` file names (max rank + 1);
        None when there are no files or one is named otherwise. Every storage entry counts, empty
        chunks included: a rank whose shards are all empty (a tensor with fewer rows than ranks, or a
        save of empty tensors only) still wrote its file, and leaving it out under-counted the ranks;
        so does the empty file of a rank that had no entries."""
        paths = {i.relative_path for i in self.metadata.storage_data.values()}
        ranks = [_RANK_FILE.match(p) for p in paths]
        if not paths or not all(ranks):
            return None
        top = max(int(m.group(1)) for m in ranks if m)
        # ranks left with no entries at all (DCP's de-duplication gives replicated entries to the
        # lower ranks) still wrote an empty file, which .metadata does not reference; a non-empty file
        # it does not reference is a leftover of an earlier save into this directory, and not counted
        for name, size in self._directory_sizes().items():
            m = _RANK_FILE.match(name)
            if m and size == 0 and name not in paths:
                top = max(top, int(m.group(1)))
        return top + 1

    def _directory_sizes(self) -> dict[str, int]:
        """Size of every file directly in the DCP directory (the listing already made on object stores)."""
        if self._sizes is not None:
            return {k: v for k, v in self._sizes.items() if "/" not in k}
        out = {}
        with os.scandir(self.directory) as it:
            for e in it:
                if e.is_file(follow_symlinks=False):
                    out[e.name] = e.stat(follow_symlinks=False).st_size
        return out

    @cached_property
    def export_record(self) -> ExportRecord | None:
        """What export-dcp recorded of the ragckpt checkpoint this DCP checkpoint came from, if it did
        (read once: the world size, the layout and the summary all ask)."""
        return read_export_record(self.metadata)

    @property
    def planner_data(self) -> dict[str, Any]:
        pd = getattr(self.metadata, "planner_data", None)
        return pd if isinstance(pd, dict) else {}

    # -- file access ------------------------------------------------------------------------------
    @contextmanager
    def _source(self, path: str, start: int | None = None) -> Iterator[ByteSource]:
        """Where reads of data file `path` go. Locally: a read-only descriptor, kept open for small
        file counts, opened per use past that so a save by thousands of ranks cannot exhaust the
        descriptor limit. On an object store: the store's range reads, served from memory for a small
        record (at `start`) that the header pass fetched whole."""
        if self._sizes is not None:
            src: ByteSource = StoreSource(self.store, path, self._sizes[path])
            whole = None if start is None else self._whole.get((path, start))
            yield src if whole is None else PrefetchedSource(src, [(start, whole)])
            return
        with self._lock:
            cached = self._fds.get(path)
            if cached is None and len(self._fds) < _FD_CACHE_MAX:
                cached = self._fds[path] = FdSource(os.open(os.path.join(self.directory, path), os.O_RDONLY))
        if cached is not None:
            yield cached
            return
        fd = os.open(os.path.join(self.directory, path), os.O_RDONLY)
        try:
            yield FdSource(fd)
        finally:
            os.close(fd)

    def _fetch(self, wanted: dict[str, list[tuple[int, int]]], *, gap: int) -> dict[str, PrefetchedSource]:
        """Fetch byte ranges of several objects (path -> ranges) in one concurrent batch of coalesced
        requests; per path, a source that serves reads inside those ranges from memory."""
        assert self._sizes is not None
        reqs = [(path, a, b) for path, rs in wanted.items()
                for a, b in coalesce_ranges(rs, gap=gap, max_bytes=_COALESCE_MAX_BYTES)]
        got = self.store.read_ranges(reqs)
        pieces: dict[str, list[tuple[int, Buffer]]] = {}
        for (path, a, _), data in zip(reqs, got, strict=True):
            pieces.setdefault(path, []).append((a, data))
        return {path: PrefetchedSource(StoreSource(self.store, path, self._sizes[path]), ps)
                for path, ps in pieces.items()}

    def _header_sources(self, chunks: list[DcpChunk]) -> dict[str, PrefetchedSource]:
        """The header windows of `chunks` (object stores), fetched together; small records are kept
        whole (up to a memory budget) so that reading their elements needs no further request."""
        wanted: dict[str, list[tuple[int, int]]] = {}
        for c in chunks:
            wanted.setdefault(c.path, []).extend(record_header_ranges(c.start, c.length))
        srcs = self._fetch(wanted, gap=_COALESCE_GAP_BYTES)
        with self._lock:
            for c in chunks:
                if c.length <= WHOLE_RECORD_BYTES and self._whole_bytes + c.length <= _WHOLE_CACHE_BYTES:
                    if (c.path, c.start) not in self._whole:
                        self._whole[(c.path, c.start)] = srcs[c.path].pread(c.length, c.start)
                        self._whole_bytes += c.length
        return srcs

    def close(self) -> None:
        with self._lock:
            for src in self._fds.values():
                os.close(src.fd)
            self._fds.clear()
            self._whole.clear()
            self._whole_bytes = 0

    def __enter__(self) -> DcpCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def read_bytes(self, key: str, src: ByteSource | None = None) -> bytes:
        """The stored bytes of non-tensor entry `key` (from `src` when given: a prefetched file)."""
        info = self.bytes_entries[key]
        if src is not None:
            raw = src.pread(int(info.length), int(info.offset))
        else:
            with self._source(info.relative_path) as s:
                raw = s.pread(int(info.length), int(info.offset))
        if len(raw) != int(info.length):
            raise FormatError(f"{self._where(info.relative_path)} is truncated (entry '{key}')")
        return raw

    def read_all_bytes(self) -> dict[str, bytes]:
        """Every non-tensor entry's bytes, in metadata order. On an object store they are fetched in
        a few coalesced concurrent requests: a flattened optimizer state dict has one entry per
        parameter and hyperparameter (thousands), written back to back, and a request each would
        take minutes."""
        if self._sizes is None:
            return {key: self.read_bytes(key) for key in self.bytes_entries}
        wanted: dict[str, list[tuple[int, int]]] = {}
        for info in self.bytes_entries.values():
            a = int(info.offset)
            wanted.setdefault(info.relative_path, []).append((a, a + int(info.length)))
        srcs = self._fetch(wanted, gap=0)
        return {key: self.read_bytes(key, srcs[info.relative_path]) for key, info in self.bytes_entries.items()}

    def _record(self, t: DcpTensor, c: DcpChunk, src: ByteSource) -> TensorRecord:
        """The parsed header of chunk `c` (parsed once, then reused by every read). On an object store
        a header not parsed yet is fetched in its few windows, not read piece by piece through `src`."""
        rec = self._records.get((c.path, c.start))
        if rec is not None:
            return rec
        if self._sizes is not None:
            src = self._header_sources([c])[c.path]
        return self._parse(t, c, src)

    def _parse(self, t: DcpTensor, c: DcpChunk, src: ByteSource) -> TensorRecord:
        where = f"{self._where(c.path)} at byte {c.start} (tensor '{t.key}', chunk {c.offsets})"
        rec = parse_tensor_record(src, c.start, c.length, where)
        if rec.dtype != torch_dtype(t.dtype):
            raise FormatError(f"{where}: holds {rec.dtype}, the metadata says {t.dtype}")
        if tuple(rec.shape) != c.sizes:
            raise FormatError(f"{where}: holds shape {tuple(rec.shape)}, the metadata says {c.sizes}")
        with self._lock:
            self._records[(c.path, c.start)] = rec
        return rec

    def check_records(self, workers: int | None = None) -> None:
        """Parse every chunk's record header (zip directory and data.pkl, a few KiB each) before anything
        is written, so a damaged file fails the import up front instead of leaving a half-written
        destination; the parsed offsets are then reused by every read. Local files are parsed by
        `workers` threads; on an object store the headers are fetched in batches of coalesced
        requests (`ragckpt.concurrency` in flight), the next batch while this one is parsed."""
        jobs = [(t, c) for t in self.tensors.values() for c in t.chunks if (c.path, c.start) not in self._records]
        if self._sizes is None:
            def one(job: tuple[DcpTensor, DcpChunk]) -> None:
                with self._source(job[1].path) as src:
                    self._record(job[0], job[1], src)

            with ThreadPoolExecutor(max(1, workers or default_workers())) as ex:
                list(ex.map(one, jobs))
            return
        batches = [jobs[i : i + _HEADER_BATCH] for i in range(0, len(jobs), _HEADER_BATCH)]
        if not batches:
            return
        with ThreadPoolExecutor(1) as fetcher:
            pending = fetcher.submit(self._header_sources, [c for _, c in batches[0]])
            for i, batch in enumerate(batches):
                srcs = pending.result()
                if i + 1 < len(batches):
                    pending = fetcher.submit(self._header_sources, [c for _, c in batches[i + 1]])
                for t, c in batch:
                    self._parse(t, c, srcs[c.path])

    def read_flat(self, key: str, start: int, stop: int, out: torch.Tensor) -> None:
        """Fill `out` (1-D, `stop - start` elements) with flat elements `[start, stop)` of tensor `key`,
        reading only the bytes of the saved chunks that overlap that range."""
        t = self.tensors[key]
        if stop <= start:
            return
        shape = t.shape
        if not shape:  # 0-d: one chunk, one element
            c = t.chunks[0]
            with self._source(c.path, c.start) as src:
                rec = self._record(t, c, src)
                copy_runs(out, [0], read_record_elements(src, rec, 0, 1, self._where(c.path)), [0], [1])
            return
        for boff, bsize in flat_range_to_boxes(shape, start, stop):
            b_off = np.asarray(boff, dtype=np.int64)
            b_end = b_off + np.asarray(bsize, dtype=np.int64)
            hit = np.nonzero((t._offs < b_end).all(axis=1) & (t._ends > b_off).all(axis=1))[0]
            for ci in hit.tolist():
                c = t.chunks[ci]
                lo_box = np.maximum(b_off, t._offs[ci])
                size = np.minimum(b_end, t._ends[ci]) - lo_box
                g, loc, run = _box_runs(shape, lo_box, size, lo_box - t._offs[ci], c.sizes)
                first, last = int(loc.min()), int(loc.max()) + run
                # one run in both spaces (a row range of a row-split chunk, the usual case): read straight
                # into place, with no staging buffer (per-call allocations stay in glibc's thread arenas)
                direct = out.is_contiguous() and (len(g) == 1 or (bool((np.diff(g) == run).all())
                                                                  and bool((np.diff(loc) == run).all())))
                at = int(g[0]) - start
                with self._source(c.path, c.start) as src:
                    rec = self._record(t, c, src)
                    if direct and read_record_elements_into(src, rec, first, out[at : at + last - first],
                                                            self._where(c.path)):
                        continue
                    data = read_record_elements(src, rec, first, last, self._where(c.path))
                copy_runs(out, g - start, data, loc - first, np.full(len(g), run, dtype=np.int64))



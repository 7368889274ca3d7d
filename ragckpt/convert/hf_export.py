"""Export a ragckpt checkpoint to Hugging Face safetensors, streaming.

The output layout (which tensor goes to which file, at which byte offset) is fixed before any data
moves, so every output tensor is assembled block by block with checksum-verified
`Checkpoint.read_flat` range reads straight into its place in the file. A bounded window of blocks is
in flight at once, so peak memory is set by `memory_bytes`, not by the model size, and no rank buffer
or full tensor is ever materialised. Files are written under a temporary name, fsynced and made
world-readable (0644; `save_file` leaves 0600); only when every shard is complete are they renamed
into place (an old model's index removed first), and the index goes last, so a reader that finds
`model.safetensors.index.json` finds every shard it names complete and never a mix of two models.

Name mapping: ragckpt keeps model weights under their plain `state_dict()` names, which are the
Hugging Face names, so the mapping is the identity; optimizer state (`optim.state.<param>.<key>`)
and engine extras (`extra.*`) are not model weights and are left out unless asked for. Bytes are
never converted unless a cast is asked for (`--dtype`), so every dtype survives bit-exactly.
"""

from __future__ import annotations

import ctypes
import fnmatch
import json
import math
import os
import re
import stat
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from concurrent.futures import Future
from contextlib import closing
from dataclasses import dataclass, field
from itertools import islice

import fsspec
import numpy as np

from ragckpt.args import check_flag
from ragckpt.checkpoint.manifest import parse_json
from ragckpt.checkpoint.partial import PartialBlocks
from ragckpt.checkpoint.reader import Checkpoint, TensorMeta
from ragckpt.checkpoint.reader import open as open_checkpoint
from ragckpt.checkpoint.writer import DEFAULT_MEMORY_BYTES, check_memory_budget, default_workers
from ragckpt.cpus import usable_cpus
from ragckpt.errors import DestinationError, DestinationExistsError, FormatError, OptionError, StorageError
from ragckpt.format.dtypes import as_bytes, from_bytes, itemsize, torch_dtype
from ragckpt.format.names import is_model_weight
from ragckpt.sizes import parse_size
from ragckpt.storage.config import S3_MIN_PART
from ragckpt.storage.destination import require_separate
from ragckpt.storage.direct import ThreadBuffers
from ragckpt.storage.remote import RemoteStore, S3Store
from ragckpt.storage.store import LocalStore, fsync_dir, local_path, missing_dirs, open_store
from ragckpt.storage.upload import StreamingUpload
from ragckpt.workpool import StoppablePool

from .safetensors_io import (
    INDEX_NAME,
    METADATA_KEY,
    SINGLE_NAME,
    DuplicateKeyError,
    OutTensor,
    assign_shards,
    build_header,
    fsspec_options,
    natural_key,
    shard_file_names,
    st_dtype_code,
    storage_order,
    unique_keys,
)

MAX_BLOCK_BYTES = 8 << 20  # well under glibc's 32 MiB mmap threshold: freed reads are reused, not re-faulted
CAST_DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
               "fp32": "float32", "float32": "float32"}
CASTABLE = ("float64", "float32", "float16", "bfloat16")  # fp8 keeps its scale semantics: never cast
HF_META_KEY = "hf"  # user-metadata key where import_hf records the source (and config.json)
#: under HF_META_KEY: the model weights import_hf found under a name ragckpt reserves for engine state
#: (a submodule called `optim` or `extra`), so that export still counts them as weights
RESERVED_WEIGHTS_KEY = "weights_with_reserved_names"


def recorded_weights(user: Mapping) -> set[str]:
    """Names an import recorded as model weights though they start with a reserved prefix."""
    hf = user.get(HF_META_KEY)
    names = hf.get(RESERVED_WEIGHTS_KEY) if isinstance(hf, Mapping) else None
    return {n for n in names if isinstance(n, str)} if isinstance(names, list) else set()


def _cast_target(dtype: str | None) -> str | None:
    if dtype in (None, "keep"):
        return None
    try:
        return CAST_DTYPES[dtype]
    except KeyError:
        raise ValueError(f"--dtype '{dtype}' is unknown; use bf16, fp16, fp32 or keep") from None


# ==========================================================================================================
# export
# ==========================================================================================================

def output_dtype(name: str, src_dtype: str, dtype: str | None, weights: Collection[str] = ()) -> str:
    """The dtype tensor `name` of `src_dtype` is exported as under `--dtype dtype`. Only model
    weights (including `weights`, see `recorded_weights`) are cast: optimizer state and extras that
    `--all-tensors` brings along keep their dtype (Adam's `step` is a float32 0-d tensor that bf16
    would round, fp16 overflow; its second moments would underflow)."""
    target = _cast_target(dtype)
    weight = is_model_weight(name) or name in weights
    return target if target is not None and src_dtype in CASTABLE and weight else src_dtype


def output_nbytes(meta: TensorMeta, dtype: str | None, weights: Collection[str] = ()) -> int:
    return meta.numel * itemsize(output_dtype(meta.name, meta.dtype, dtype, weights))


@dataclass
class ExportResult:
    out_dir: str
    files: list[str]
    tensors: int
    bytes: int
    seconds: float
    excluded: int  # tensors of the checkpoint left out (optimizer state, extras, --include misses)
    renamed: int
    cast: int  # tensors whose dtype was changed
    wrote_config: bool
    #: OUT_DIR holds a config.json after the export (without one, from_pretrained cannot load it)
    has_config: bool = False

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass(frozen=True)
class _Plan:
    """One output tensor: its checkpoint source and where its bytes go."""

    src: str
    out: OutTensor
    src_dtype: str
    file: int
    offset: int  # absolute byte offset in the file


def load_rename_map(path: str) -> dict[str, str]:
    """A JSON object {checkpoint_name: output_name}."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = parse_json(f.read(), object_pairs_hook=unique_keys)
    except FileNotFoundError:
        raise FormatError(f"rename map {path}: no such file") from None
    except DuplicateKeyError as e:
        raise FormatError(f"rename map {path}: '{e.args[0]}' is mapped twice; keep one entry") from None
    except ValueError as e:
        raise FormatError(f"rename map {path}: not valid JSON ({e.args[0]})") from None
    if not isinstance(doc, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in doc.items()):
        raise FormatError(f"rename map {path}: must be a JSON object mapping old names to new names (strings)")
    return doc


def select_tensors(names: Sequence[str], *, include: Sequence[str] | None, all_tensors: bool,
                   rename_map: Mapping[str, str] | None, weights: Collection[str] = ()) -> list[tuple[str, str]]:
    """(checkpoint name, output name) pairs: model weights (or everything with `all_tensors`),
    filtered by the `include` globs, then renamed. `weights` are names that count as model weights
    despite a reserved prefix (`recorded_weights`). Fails on a rename-map key the checkpoint lacks or
    on two tensors that end up with the same output name."""
    rename_map = dict(rename_map or {})
    known = set(names)
    unknown = [k for k in rename_map if k not in known]
    if unknown:
        raise FormatError(f"rename map names '{unknown[0]}', which is not in the checkpoint"
                          + (f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""))
    weights = set(weights)
    picked = [n for n in names if all_tensors or is_model_weight(n) or n in weights]
    if include:
        def matches(n: str) -> bool:
            return any(fnmatch.fnmatchcase(n, p) for p in include)

        picked = [n for n in picked if matches(n)]
        if not picked and any(map(matches, names)):
            raise FormatError(f"--include {' '.join(include)} matches only optimizer state or extra.* tensors, "
                              "which export-hf leaves out by default; add --all-tensors (all_tensors=True)")
    if not picked:
        raise FormatError("no tensors selected for export" + (f" (--include {' '.join(include)} matched nothing)"
                                                               if include else ""))
    out: dict[str, str] = {}
    pairs = []
    for n in picked:
        new = rename_map.get(n, n)
        if not new or new == METADATA_KEY:
            if n in rename_map:
                raise FormatError(f"rename map gives '{n}' the invalid name '{new}'")
            raise FormatError(f"tensor '{n}' cannot keep its name in safetensors (an empty name and "
                              f"'{METADATA_KEY}' are not allowed); rename it with --rename-map (rename_map=) or "
                              "leave it out with --include")
        if new in out:
            raise FormatError(f"name clash after renaming: '{out[new]}' and '{n}' both become '{new}'")
        out[new] = n
        pairs.append((n, new))
    return pairs


def _sync_file_range() -> Callable[[int], None] | None:
    """Linux `sync_file_range(fd, 0, 0, SYNC_FILE_RANGE_WRITE)`: start writeback of a file's dirty
    pages without waiting. Kicked while writing, it overlaps the disk with the copy, so the final
    fsync finds little left (measured here: write+fsync of 1 GiB in about half the time)."""
    try:
        if not sys.platform.startswith("linux"):
            return None
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.sync_file_range
        fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    except (OSError, AttributeError):
        return None
    return lambda fd: fn(fd, 0, 0, 2)


_KICK = _sync_file_range()
_KICK_BYTES = 8 << 20


class _LocalSink:
    """A local output file: temp name, positional writes, fsync, 0644, atomic rename."""

    def __init__(self, out_dir: str, name: str, size: int, durable: bool = True):
        self.final = os.path.join(out_dir, name)
        self.tmp = os.path.join(out_dir, f".{name}.{uuid.uuid4().hex}.tmp")
        self.fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.ftruncate(self.fd, size)
        self.kick = _KICK if durable else None
        self.unkicked = 0

    def write(self, offset: int, data: memoryview) -> None:
        """Positional write; safe from several threads at once (regions never overlap)."""
        while len(data):
            n = os.pwrite(self.fd, data, offset)
            data, offset = data[n:], offset + n

    def wrote(self, nbytes: int) -> None:
        """Bookkeeping from the single consumer thread: start writeback every few MiB."""
        self.unkicked += nbytes
        if self.kick is not None and self.unkicked >= _KICK_BYTES:
            self.kick(self.fd)
            self.unkicked = 0

    def finish(self, durable: bool) -> None:
        """Complete the file under its temporary name (fsynced if `durable`); `commit` renames it."""
        if durable:
            os.fsync(self.fd)
        os.fchmod(self.fd, 0o644)  # independent of the umask: inference servers often run as another user
        os.close(self.fd)
        self.fd = -1

    def commit(self) -> None:
        os.replace(self.tmp, self.final)

    def close(self, durable: bool) -> None:
        self.finish(durable)
        self.commit()

    def abort(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        try:
            os.unlink(self.tmp)
        except FileNotFoundError:
            pass


class _RemoteSink:
    """An object-store output file: written strictly in order; the store makes it visible only when
    the upload completes on close, which is the atomic step. On S3 the bytes go through a
    `StreamingUpload` (a few reused part buffers); other fsspec stores get their own buffered writer
    with the same part size."""

    def __init__(self, od: _OutDir, name: str, size: int, defer: bool = False):
        self.path = od.join(name)
        if isinstance(od.store, S3Store):
            # deferred: `finish` sends every part, `commit` makes the file visible
            self.f = od.store.upload_stream(name, size, part_bytes=od.part_bytes, buffers=od.part_buffers,
                                            defer_complete=defer)
        else:
            self.f = od.fs.open(self.path, "wb", block_size=od.part_bytes)
        self.pos = 0

    def write(self, offset: int, data: memoryview) -> None:
        if offset != self.pos:
            raise AssertionError(f"remote writes must be sequential ({offset} != {self.pos})")
        self.f.write(data)
        self.pos += len(data)

    def wrote(self, nbytes: int) -> None:
        pass

    def finish(self, durable: bool) -> None:
        self.f.close()

    def commit(self) -> None:
        if isinstance(self.f, StreamingUpload):
            self.f.complete()  # a no-op unless deferred; otherwise the upload became visible at `finish`

    def close(self, durable: bool) -> None:
        self.finish(durable)

    def abort(self) -> None:
        if self.f.closed:
            return  # already uploaded: removing it is the caller's business
        try:
            if isinstance(self.f, StreamingUpload):
                self.f.abort()
            elif hasattr(self.f, "discard"):
                self.f.discard()
            else:
                self.f.close()
        except Exception:  # noqa: BLE001 - best effort cleanup on the error path
            pass


def _write_target(fs: object, path: str) -> str:
    """Where an fsspec file system writes `path`: s3fs cuts a "?versionId=..." off the key."""
    split = getattr(fs, "split_path", None)
    if split is not None:
        parts = split(path)
        if len(parts) == 3:  # (bucket, key, version id)
            return f"{parts[0]}/{parts[1]}".rstrip("/")  # the version part is no part of the key
    return path.rstrip("/")


def _segments(path: str) -> list[str]:
    """A path's non-empty segments: fsspec roots some paths ("memory://out" is "/out") and S3 URLs
    may double their slashes (the store reads "s3://b//p" as "b/p")."""
    return [s for s in path.split("/") if s]


class _OutDir:
    """The output directory, local or fsspec, with the few operations export needs."""

    def __init__(self, url: str, storage_options: Mapping | None):
        self.url = url
        path = local_path(url)
        self.local = path is not None
        url = path if path is not None else url
        self.store: RemoteStore | None = None  # remote OUT_DIRs
        # remote files upload in parts: `part_buffers` buffers of `part_bytes` (`plan_uploads`)
        self.part_bytes, self.part_buffers = S3_MIN_PART, 2
        if self.local:
            self.path = os.path.abspath(url)
            self.fs = None
        else:
            # the storage layer's checks first: a missing bucket, an unreachable server, an fsspec
            # backend that is not installed or bad options are then one line naming the URL
            self.store = open_store(url, dict(storage_options or {}))
            self.store.check_root()
            opts = fsspec_options(storage_options)
            if url.startswith(("s3://", "s3a://")):
                opts.setdefault("skip_instance_cache", True)  # no client cached across event loops
            literal = url.split("://", 1)[1]
            parsed = None if "::" in url else fsspec.core.url_to_fs(url, **opts)
            target = None if parsed is None else _write_target(*parsed)
            if target is None or _segments(target) != _segments(literal):
                # fsspec reads "?versionId=" as a version and "::" as a chain of URLs: the files would
                # land on other keys (one replaced a user's object outside OUT_DIR), so refuse
                where = "" if target is None else f" (it would write to '{target}')"
                raise DestinationError(f"export-hf cannot write under {url}: fsspec takes '?' or '::' in it for "
                                       f"a version or a chain of URLs{where}; choose an OUT_DIR without them")
            self.fs, self.path = parsed
            self.path = self.path.rstrip("/")
            if isinstance(self.store, S3Store):  # list and delete where the store writes (s3://b//p is b/p)
                self.path = f"{self.store.bucket}/{self.store.prefix}".rstrip("/")

    def join(self, name: str) -> str:
        return os.path.join(self.path, name) if self.local else f"{self.path}/{name}"

    def listdir(self) -> list[str]:
        if self.local:
            return sorted(os.listdir(self.path)) if os.path.isdir(self.path) else []
        try:
            # s3fs caches listings; uploads through the S3 store (another client) do not update it
            self.fs.invalidate_cache(self.path)
            return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.path, detail=False))
        except FileNotFoundError:
            return []
        except Exception as e:  # noqa: BLE001 - worded for the user with the URL
            raise StorageError(f"cannot list {self.url}: {e}") from e

    def makedirs(self) -> list[str]:
        """Create the directory (local only) and return the directories this call created,
        deepest first, so a failed export can remove exactly those and nothing that was there."""
        if not self.local:
            return []
        if os.path.exists(self.path) and not os.path.isdir(self.path):
            raise DestinationError(f"{self.path} exists and is not a directory; choose another OUT_DIR")
        created = missing_dirs(self.path)
        os.makedirs(self.path, exist_ok=True)
        for d in created:  # as the files: a server running as another user must reach them under umask 077
            os.chmod(d, stat.S_IMODE(os.stat(d).st_mode) | 0o755)  # adds only: setgid, group-write stay
        return created

    def read_small(self, name: str) -> bytes | None:
        """A small file's bytes, or None if it cannot be read."""
        try:
            if self.local:
                with open(self.join(name), "rb") as f:
                    return f.read()
            return self.fs.cat_file(self.join(name))
        except (OSError, ValueError):
            return None

    def sink(self, name: str, size: int, durable: bool, *, defer: bool = False) -> _LocalSink | _RemoteSink:
        """A new file; `defer`: an upload is made visible only by its `commit` (local files always are)."""
        return _LocalSink(self.path, name, size, durable) if self.local else _RemoteSink(self, name, size, defer)

    @property
    def deferrable(self) -> bool:
        """Whether uploads here can wait for `commit` to become visible (S3's multipart uploads can;
        other fsspec writers publish on close)."""
        return self.local or isinstance(self.store, S3Store)

    def plan_uploads(self, memory_bytes: int) -> int:
        """Size the part buffers of remote files from the export's budget; returns what is left
        for reading. One remote file is written at a time (they are written in order)."""
        if self.local:
            return memory_bytes
        self.part_bytes = max(S3_MIN_PART, min(self.store.cfg.part_size, memory_bytes // 8))
        self.part_buffers = max(2, min(4, memory_bytes // (4 * self.part_bytes)))
        return max(memory_bytes // 4, memory_bytes - self.part_buffers * self.part_bytes)

    def write_small(self, name: str, data: bytes, durable: bool) -> None:
        s = self.sink(name, len(data), durable)
        try:
            s.write(0, memoryview(data))
            s.close(durable)
        except BaseException:
            s.abort()
            raise

    def remove(self, name: str) -> None:
        if self.local:
            os.unlink(self.join(name))
        else:
            self.fs.rm_file(self.join(name))

    def sync_dir(self) -> None:
        if self.local:
            fsync_dir(self.path)

    def remove_stale_temps(self, listing: Sequence[str]) -> list[str]:
        """Delete the hidden temporary files (`_TEMP_NAME`) a killed earlier export left in a local
        OUT_DIR; return their names. Object stores have none: an upload is never visible half done."""
        if not self.local:
            return []
        gone = []
        for name in listing:
            if _TEMP_NAME.match(name):
                try:
                    if stat.S_ISREG(os.lstat(self.join(name)).st_mode):  # a directory or link is not ours
                        os.unlink(self.join(name))
                        gone.append(name)
                except OSError:
                    pass  # gone already, or not ours to delete: the export itself decides
        return gone


_SHARD_NAME = re.compile(r"^model-\d{5,}-of-\d{5,}\.safetensors$")
# exactly the temporary names _LocalSink gives the files export writes: `.<name>.<uuid4 hex>.tmp`
_TEMP_NAME = re.compile(r"^\.(model\.safetensors|model-\d{5,}-of-\d{5,}\.safetensors|model\.safetensors\.index\.json"
                        r"|config\.json)\.[0-9a-f]{32}\.tmp$")


def _previous_model_files(od: _OutDir, listing: Sequence[str]) -> list[str]:
    """The weight files of a model export-hf (or save_pretrained) wrote in `od`: `model.safetensors`,
    `model-NNNNN-of-NNNNN.safetensors`, the index and the `.safetensors` files its weight_map names.
    Only these count as "model weights" for the refusal without --overwrite and only these are
    replaced with it: other safetensors files (a LoRA `adapter_model.safetensors`) are not ours."""
    present = set(listing)
    found = {n for n in present if n in (SINGLE_NAME, INDEX_NAME) or _SHARD_NAME.match(n)}
    if INDEX_NAME in present:
        try:
            weight_map = parse_json(od.read_small(INDEX_NAME) or b"").get("weight_map")
        except (ValueError, AttributeError):
            weight_map = None  # a garbled index: the index itself still goes, nothing it names
        if isinstance(weight_map, dict):
            # only plain names of files in OUT_DIR: an index cannot point a deletion elsewhere
            found |= {f for f in weight_map.values() if isinstance(f, str) and f in present
                      and f.endswith(".safetensors")}
    return sorted(found)


@dataclass
class _Task:
    """Reads of one buffer's rank ranges whose bytes land at `offsets` of output file `file`."""

    file: int
    buffer: int
    src_dtype: str
    out_dtype: str
    reqs: list[tuple[int, int, int]] = field(default_factory=list)  # (rank, byte start, byte stop)
    offsets: list[int] = field(default_factory=list)
    nbytes: int = 0  # bytes read
    out_bytes: int = 0  # bytes written (differs under a cast)


def _read_tasks(ck: Checkpoint, plans: Sequence[_Plan], step: int) -> list[_Task]:
    """Map every output tensor to the rank-buffer byte ranges holding it (the layout's segment
    table), cut at multiples of `step` in rank-buffer coordinates so reads cover whole checksum
    blocks, and pack consecutive small ranges into one task (tiny tensors such as norms would
    otherwise cost a thread hand-off each). Tasks come in output-file order, so a sequential sink
    (object storage) can take them as they are."""
    tasks: list[_Task] = []
    cur: _Task | None = None
    for p in plans:
        bi, slot = ck.layout.locate(p.src)
        seg = ck.layout.layout_of(bi).segments().for_slot(slot)
        isz, osz = itemsize(p.src_dtype), itemsize(p.out.dtype)
        for r, off, fs, length in zip(seg.rank.tolist(), seg.offset.tolist(), seg.flat_start.tolist(),
                                      seg.length.tolist(), strict=True):
            a, end = off * isz, (off + length) * isz
            while a < end:
                b = min(end, (a // step + 1) * step)
                if (cur is None or cur.file != p.file or cur.buffer != bi or cur.out_dtype != p.out.dtype
                        or cur.nbytes + (b - a) > step or len(cur.reqs) >= 256):
                    cur = _Task(p.file, bi, p.src_dtype, p.out.dtype)
                    tasks.append(cur)
                cur.reqs.append((r, a, b))
                cur.offsets.append(p.offset + (fs + a // isz - off) * osz)
                cur.nbytes += b - a
                cur.out_bytes += (b - a) // isz * osz
                a = b
    return tasks


def _ordered_pipeline(fn: Callable, tasks: Sequence, workers: int, window: int) -> Iterator:
    """`map(fn, tasks)` on a thread pool with at most `window` results alive at once, in order.
    The window is what bounds memory: a finished block waits for the writer, never piles up. A
    `StoppablePool`: once a task fails, or the consumer stops (an error, Ctrl-C, SIGTERM; close the
    generator, e.g. with `contextlib.closing`), no further task starts, the consumer gets the first
    real failure, and the generator returns only when no worker still writes into the sinks that the
    caller's clean-up is about to delete."""
    with StoppablePool(workers) as pool:
        it = iter(tasks)
        pending: deque[Future] = deque(pool.submit(fn, t) for t in islice(it, max(1, window)))
        while pending:
            res = pool.result(pending.popleft())
            for t in it:
                pending.append(pool.submit(fn, t))
                break
            yield res


def _remove_created(od: _OutDir, before: set[str], ours: set[str], created_dirs: Sequence[str]) -> None:
    """After a failed export: delete the files of `ours` that were not in OUT_DIR before it started,
    then the directories it created (rmdir: one that somebody else wrote into stays). Best effort:
    the export's own error is what the user needs to see."""
    try:
        for name in od.listdir():
            if name in ours and name not in before:
                od.remove(name)
    except Exception:  # noqa: BLE001 - cleanup must not mask the failure
        pass
    for d in created_dirs:
        try:
            os.rmdir(d)
        except OSError:
            break


def export_hf(
    src: str,
    out_dir: str,
    *,
    dtype: str | None = "keep",
    max_shard_size: str | int = "5GB",
    include: Sequence[str] | None = None,
    rename_map: Mapping[str, str] | str | None = None,
    all_tensors: bool = False,
    overwrite: bool = False,
    memory_bytes: int = DEFAULT_MEMORY_BYTES,
    workers: int | None = None,
    storage_options: dict | None = None,
    progress: Callable[[int], None] | None = None,
    durable: bool = True,
    write_config: bool = True,
    config: Mapping | str | None = None,
) -> ExportResult:
    """Write the model weights of checkpoint `src` as a Hugging Face safetensors model in `out_dir`
    (`model.safetensors`, or `model-0000i-of-0000N.safetensors` + `model.safetensors.index.json`
    when larger than `max_shard_size`). Streams: about `memory_bytes` of working memory whatever the
    model size. `dtype` casts floating tensors (fp8 excepted) to bf16/fp16/fp32; `include` keeps names
    matching any glob; `rename_map` ({old: new} or a JSON file path) renames. Existing weight files
    in `out_dir` (`model.safetensors`, `model-NNNNN-of-NNNNN.safetensors`, the index and the files it
    names) are refused unless `overwrite`, which replaces exactly those; other files there (config,
    tokenizer, an `adapter_model.safetensors`) are left alone. `out_dir` must not overlap `src`. A
    failed export removes the files and directories it created; a failed or killed `overwrite` never
    leaves a loadable mix of the two models (see docs/CONVERT_HF.md), and hidden temporaries a killed
    export left in a local `out_dir` are removed by the next export. If the checkpoint was imported with
    `import_hf` and `out_dir` has no config.json, the recorded config.json is written too, so the
    directory loads with `from_pretrained`. `config` (a dict, or the path of a config.json) is the
    model config to write instead: a training checkpoint has none recorded, unless its job saved
    one under `user["hf"]["config"]`; an existing config.json is replaced by it only with `overwrite`."""
    check_flag("overwrite", overwrite)
    t0 = time.perf_counter()
    require_separate(out_dir, [src])  # an export into its own checkpoint would mix the two
    target = _cast_target(dtype)
    max_bytes = parse_size(max_shard_size)
    check_memory_budget(memory_bytes)
    if isinstance(rename_map, str):
        rename_map = load_rename_map(rename_map)
    given_config = _load_config(config) if config is not None else None
    ck = open_checkpoint(src, storage_options=storage_options)
    names = ck.names()
    weights = recorded_weights(ck.user)
    pairs = select_tensors(names, include=include, all_tensors=all_tensors, rename_map=rename_map, weights=weights)

    outs: dict[str, tuple[str, str]] = {}  # out name -> (src name, src dtype)
    tensors: list[OutTensor] = []
    n_cast = 0
    for n, new in pairs:
        m = ck.meta(n)
        odt = output_dtype(n, m.dtype, target, weights)
        st_dtype_code(n, odt)  # a dtype safetensors cannot hold is refused here, before anything is written
        n_cast += odt != m.dtype
        outs[new] = (n, m.dtype)
        tensors.append(OutTensor(new, odt, tuple(m.shape)))
    tensors.sort(key=lambda t: natural_key(t.name))
    shards = [storage_order(s) for s in assign_shards(tensors, max_bytes)]
    fnames = shard_file_names(len(shards))

    od = _OutDir(out_dir, storage_options)
    before = od.listdir()
    if {"zarr.json", "COMMITTED"} & set(before):
        raise DestinationExistsError(f"{od.url} holds a ragckpt checkpoint (or another zarr store); model files "
                                     "would be mixed into it: choose another OUT_DIR")
    existing = _previous_model_files(od, before)
    if existing and not overwrite:
        raise DestinationExistsError(f"{od.url} already holds model weights ({existing[0]}); choose an empty "
                                     "directory or pass --overwrite to replace them")
    if given_config is not None and "config.json" in before and not overwrite:
        raise DestinationExistsError(f"{od.url} already holds a config.json; drop the config to keep it or pass "
                                     "--overwrite to replace it")
    if od.local:  # a directory where a file goes fails only at the rename, naming the temporary file
        for name in (*fnames, INDEX_NAME, *(["config.json"] if write_config and given_config is not None else [])):
            if os.path.isdir(od.join(name)):
                raise DestinationError(f"{od.join(name)} is a directory, where export-hf writes a file; move it "
                                       "away or choose another OUT_DIR")

    headers: list[bytes] = []
    plans: list[_Plan] = []
    for fi, shard in enumerate(shards):
        hdr, offsets = build_header(shard, {"format": "pt"})
        headers.append(hdr)
        for t, off in zip(shard, offsets, strict=True):
            s, sdt = outs[t.name]
            plans.append(_Plan(s, t, sdt, fi, off))
    file_sizes = [len(h) + sum(t.nbytes for t in s) for h, s in zip(headers, shards, strict=True)]

    # every output tensor becomes byte ranges of rank buffers, cut at `step`-aligned offsets so each
    # read is whole checksum blocks; a window of such reads is in flight at once. Remote outputs
    # first take their part buffers out of the budget.
    read_bytes = od.plan_uploads(memory_bytes)
    step = max(1 << 20, min(MAX_BLOCK_BYTES, read_bytes // 16))
    unit = math.lcm(ck.block_bytes, 16)  # whole blocks and whole elements of every dtype (a block may be 777 bytes)
    step = -(-step // unit) * unit
    # local reads are memory copies: more threads than cores only add memory; object stores are
    # latency-bound and get the wider default
    local_src = isinstance(ck.store, LocalStore)
    nworkers = max(1, workers or (min(default_workers(), usable_cpus()) if local_src else default_workers()))
    # two reads per worker keep every thread busy; more only costs memory (a read costs <= 3x its
    # size: the fetch, a join across chunk objects, a cast)
    window = max(2, min(2 * nworkers, read_bytes // (3 * step)))
    nworkers = min(nworkers, window)
    tasks = _read_tasks(ck, plans, step)

    sinks: dict[int, _LocalSink | _RemoteSink] = {}
    sink_lock = threading.Lock()
    cast_scratch = ThreadBuffers()
    # each tensor's bytes are read exactly, the blocks it shares with neighbouring tensors verified
    # from the pieces (every tensor of a many-rank row checkpoint has a slice in each rank's block:
    # whole-block reads fetched a 2048-rank source 16.8x); files go into place, or S3 uploads are
    # completed, only after every block checked. Other fsspec outputs publish a file when it is
    # closed, so they keep whole-block reads, verified before a byte is sent.
    partial = PartialBlocks(ck) if od.deferrable else None
    read_scratch = ThreadBuffers()

    def sink_for(fi: int) -> _LocalSink | _RemoteSink:
        with sink_lock:
            s = sinks.get(fi)
            if s is None:
                s = od.sink(fnames[fi], file_sizes[fi], durable, defer=partial is not None)
                sinks[fi] = s
                s.write(0, memoryview(headers[fi]))
            return s

    def cast(task: _Task, parts: list[memoryview]) -> list[memoryview]:
        """`parts` in the output dtype, in this thread's one reused buffer (a fresh tensor per part
        went to the thread's malloc arena, which kept it: 50-76 MiB peaks for a 32 MiB budget). Valid
        until this thread's next cast: the caller writes them to the sink first."""
        if task.out_dtype == task.src_dtype:
            return parts
        src = [from_bytes(mv, task.src_dtype) for mv in parts]
        buf = cast_scratch.take_tensor(sum(t.numel() for t in src), torch_dtype(task.out_dtype))
        pos, out = 0, []
        for t in src:
            out.append(as_bytes(buf[pos : pos + t.numel()].copy_(t)))
            pos += t.numel()
        return out

    def produce(task: _Task) -> tuple[_Task, list[memoryview] | None]:
        """Read (and cast) one task. Local files are written right here, by the worker: page-cache
        writes of a new file are the costliest step, and positional writes let them run on every
        core. Object stores need bytes in order, so their parts go back to the consumer, which
        casts them as it copies them into the upload's part buffers."""
        if partial is None:
            return task, ck.read_rank_ranges(task.buffer, task.reqs)
        # local files are written by this thread before its next task; an upload's consumer takes the
        # parts later, so they get memory of their own (the pipeline's window bounds how many live)
        raw = memoryview(read_scratch.take(task.nbytes) if od.local else np.empty(task.nbytes, dtype=np.uint8))
        parts, reqs, pos = [], [], 0
        for r, a, b in task.reqs:
            parts.append(raw[pos : pos + b - a])
            reqs.append((r, a, [parts[-1]]))
            pos += b - a
        ck.read_pieces(task.buffer, reqs, partial)
        if not od.local:
            return task, parts
        s = sink_for(task.file)
        for off, data in zip(task.offsets, cast(task, parts), strict=True):
            s.write(off, data)
        return task, None

    remaining = [0] * len(shards)
    for t in tasks:
        remaining[t.file] += 1
    total = 0
    # Replacing a model must never leave a loadable mix of two. A model is entered through its index
    # (sharded) or its single `model.safetensors`. Old entry points go before any new file takes the
    # place of an old one, and the new entry point comes last; local shards stay under their temporary
    # names until all are complete, so until then the old model is untouched.
    new_entry = INDEX_NAME if len(shards) > 1 else SINGLE_NAME
    overlap = bool(set(fnames) & (set(existing) - {new_entry}))  # new data files replace old ones
    unlink_first = [e for e in (INDEX_NAME, SINGLE_NAME)
                    if e in existing and (e != new_entry or (e == INDEX_NAME and overlap))]
    done: list[_LocalSink | _RemoteSink] = []  # complete files, not yet renamed into place
    # nothing above writes; from here on a failure removes what this export created (files that were
    # not in OUT_DIR before, directories it made), and leaves everything that was there alone
    stale_temps = od.remove_stale_temps(before)
    before = [n for n in before if n not in stale_temps]
    created_dirs = od.makedirs()
    try:
        if not od.local and INDEX_NAME in unlink_first and overlap:
            # an upload is visible under its final name as soon as it completes: the old index must
            # not name a new shard, so it goes first (a failure then leaves no loadable model)
            od.remove(INDEX_NAME)
            unlink_first.remove(INDEX_NAME)

        def finish(fi: int) -> None:
            s = sinks.pop(fi)
            s.finish(durable)
            done.append(s)

        for fi in range(len(shards)):  # shards without data (all tensors empty) still need their file
            if remaining[fi] == 0:
                sink_for(fi)
                finish(fi)
        # closing: on a failure here the workers stop before the clean-up below deletes their files
        with closing(_ordered_pipeline(produce, tasks, nworkers, window)) as results:
            for task, parts in results:
                s = sink_for(task.file)
                if parts is not None:
                    for off, data in zip(task.offsets, cast(task, parts), strict=True):
                        s.write(off, data)
                n = task.out_bytes
                s.wrote(n)
                total += n
                if progress is not None:
                    progress(n)
                remaining[task.file] -= 1
                if remaining[task.file] == 0:  # results arrive in order: every task of this file is done
                    finish(task.file)
        if partial is not None:
            partial.complete()  # the blocks no task read whole: checked before any file goes into place
        # every new file is complete (and durable): switch models
        for e in unlink_first:
            od.remove(e)
        if unlink_first and durable:
            od.sync_dir()  # the old entry point is gone for good before any old file is replaced
        for s in done:
            s.commit()
        done.clear()
        if len(shards) > 1:
            if durable:
                od.sync_dir()  # the shards are in place before the index names them
            index = {
                "metadata": {"total_size": sum(t.nbytes for t in tensors)},
                "weight_map": {t.name: fnames[fi] for fi, s in enumerate(shards) for t in s},
            }
            od.write_small(INDEX_NAME, json.dumps(index, indent=2).encode() + b"\n", durable)
        new = set(fnames) | ({INDEX_NAME} if len(shards) > 1 else set())
        for f in existing:
            if f not in new and f not in unlink_first:
                od.remove(f)  # stale shards of the replaced model
        wrote_config = False
        hf = ck.user.get(HF_META_KEY) or {}
        recorded = hf.get("config") if isinstance(hf, dict) and isinstance(hf.get("config"), dict) else None
        cfg = given_config if given_config is not None else recorded
        if write_config and cfg is not None and (given_config is not None or "config.json" not in od.listdir()):
            od.write_small("config.json", json.dumps(_with_dtype(cfg, target), indent=2).encode() + b"\n", durable)
            wrote_config = True
        has_config = "config.json" in od.listdir()
        if durable:
            od.sync_dir()
    except BaseException:
        for s in [*sinks.values(), *done]:
            s.abort()  # local: the temporary file goes; the old model's files were not touched
        _remove_created(od, set(before), set(fnames) | {INDEX_NAME, "config.json"}, created_dirs)
        raise
    return ExportResult(
        out_dir=od.path if od.local else od.url, files=fnames, tensors=len(tensors), bytes=total, seconds=time.perf_counter() - t0,
        excluded=len(names) - len(pairs), renamed=sum(1 for n, new in pairs if n != new), cast=n_cast,
        wrote_config=wrote_config, has_config=has_config,
    )


def _load_config(config: Mapping | str) -> dict:
    """A model config given to export: a mapping, or the path of a config.json (a JSON object)."""
    if isinstance(config, Mapping):
        return dict(config)
    try:
        with open(config, "rb") as f:
            doc = parse_json(f.read())
    except OSError as e:
        raise OptionError(f"cannot read config {config}: {e.strerror or e}") from None
    except ValueError:
        doc = None
    if not isinstance(doc, dict):
        raise OptionError(f"config {config} is not a JSON object; give the model's config.json")
    return doc


def _with_dtype(config: Mapping, target: str | None) -> dict:
    """`config` saying the exported dtype: from_pretrained would otherwise load a cast export in the
    old dtype (or, with no dtype key at all, in float32 on transformers before 5)."""
    out = dict(config)
    if target is not None:
        keys = [k for k in ("torch_dtype", "dtype") if k in out] or ["torch_dtype"]
        for key in keys:
            out[key] = target
    return out


# ==========================================================================================================
# import
# ==========================================================================================================

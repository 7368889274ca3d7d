"""export-dcp: a ragckpt checkpoint -> a DCP checkpoint directory that stock
`torch.distributed.checkpoint.load` reads at any world size, chunk by chunk, written under a
temporary sibling and swapped into place (`swap`)."""

from __future__ import annotations

import base64
import contextlib
import io
import math
import os
import pickle
import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ragckpt.args import check_flag
from ragckpt.checkpoint.reader import Checkpoint
from ragckpt.checkpoint.reader import open as open_checkpoint
from ragckpt.checkpoint.writer import (
    DEFAULT_MEMORY_BYTES,
    chunk_for_memory,
    default_workers,
)
from ragckpt.convert import DEFAULT_EXPORT_CHUNK_BYTES
from ragckpt.convert.dcp.keys import (
    MODEL_PREFIX,
    PARAM_GROUPS_PREFIX,
    PARAM_GROUPS_USER_KEY,
    USER_KEY,
    dcp_key_to_name,
    default_planner_path,
    groups_by_param,
    name_to_dcp_key,
)
from ragckpt.convert.dcp.optimizer_notes import optimizer_gaps
from ragckpt.convert.dcp.record import RECORD_KEY, export_record_value
from ragckpt.convert.dcp.swap import _entries, _remove_leftovers, _swap_in
from ragckpt.convert.dcp_format import METADATA_FILE
from ragckpt.errors import (
    DestinationError,
    DestinationExistsError,
    FormatError,
    LayoutError,
    OptionError,
    RagckptError,
)
from ragckpt.format.dtypes import itemsize, torch_dtype
from ragckpt.format.intervals import flat_range_to_boxes
from ragckpt.storage.destination import require_separate
from ragckpt.storage.direct import ThreadBuffers
from ragckpt.storage.store import fsync_dir, local_path
from ragckpt.workpool import StoppablePool

if TYPE_CHECKING:
    import torch
else:  # the CLI imports this module for its commands; torch comes in when one runs (see ragckpt.lazy)
    from ragckpt.lazy import torch

DEFAULT_EXPORT_FILE_BYTES = 1 << 30


def local_dcp_path(path: str) -> str:
    """export-dcp's output directory as a local file system path: it is written with plain file calls
    (a temporary sibling, fsync, an atomic rename), which object stores do not offer, and a URL
    (`s3://...`) would otherwise become a relative directory named `s3:`. `file://` is fine.
    (import-dcp reads its DCP input from any URL the stores support: `DcpCheckpoint`.)"""
    local = local_path(path)
    if local is None:
        raise RagckptError(f"the DCP output directory must be a local path (got {path}); export to a local "
                           "directory, then upload it (e.g. aws s3 sync DIR URL)")
    return local


# -- export ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Item:
    key: str  # DCP key
    name: str  # ragckpt name
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    flat_start: int
    numel: int
    nbytes: int


def plan_chunks(shape: tuple[int, ...], itemsize_: int, max_chunk_bytes: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """Boxes `(offsets, sizes, flat_start)` that tile a tensor, each a contiguous flat range of at most
    `max_chunk_bytes`: groups of whole rows, or pieces of one row when a row alone is larger."""
    n = math.prod(shape)
    if not shape or n == 0:
        return [((0,) * len(shape), tuple(shape), 0)]
    cap = max(1, max_chunk_bytes // itemsize_)
    rows = shape[0]
    row = n // rows
    out = []
    if row <= cap:
        per = max(1, cap // row)
        for r0 in range(0, rows, per):
            cnt = min(per, rows - r0)
            out.append(((r0, *(0,) * (len(shape) - 1)), (cnt, *shape[1:]), r0 * row))
        return out
    for r in range(rows):
        for a in range(r * row, (r + 1) * row, cap):
            b = min(a + cap, (r + 1) * row)
            for off, size in flat_range_to_boxes(shape, a, b):
                fs = sum(o * s for o, s in zip(off, _strides(shape), strict=True))
                out.append((tuple(off), tuple(size), fs))
    return out


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, acc = [], 1
    for s in reversed(shape):
        out.append(acc)
        acc *= s
    return tuple(reversed(out))


@dataclass
class ExportSummary:
    source: str
    destination: str
    tensors: int
    non_tensor_entries: int
    chunks: int
    files: int
    tensor_bytes: int
    model_prefix: str
    #: what a torch optimizer loading this DCP checkpoint will miss, and what of the source the export
    #: cannot hold (user metadata, per-rank extras): one line each
    warnings: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return dict(self.__dict__)


def export_dcp(
    src: str,
    out_dir: str,
    *,
    overwrite: bool = False,
    model_prefix: str | None = None,
    max_chunk_bytes: int = DEFAULT_EXPORT_CHUNK_BYTES,
    max_file_bytes: int = DEFAULT_EXPORT_FILE_BYTES,
    workers: int | None = None,
    memory_bytes: int = DEFAULT_MEMORY_BYTES,
    storage_options: dict | None = None,
    progress: Callable[[int], None] | None = None,
    on_plan: Callable[[int], None] | None = None,
) -> ExportSummary:
    """Write ragckpt checkpoint `src` as a DCP checkpoint directory `out_dir` that
    `torch.distributed.checkpoint.load` reads into any sharding (e.g. FSDP2 at any world size).
    `out_dir` is a local path that must not overlap `src`. An absent `out_dir` appears atomically (a
    temporary sibling renamed into place); an empty existing directory (a fresh mount point) is
    written into, `.metadata` last; anything else is refused unless `overwrite`, which swaps the new
    tree in (or replaces the contents in place where the directory cannot be renamed). `.metadata`
    records `src`'s world size and layout (`export_record_value`) in `planner_data`, which torch's
    loaders ignore, so that importing the export back needs no `--world-size`: the files are all
    written by one process and named `__0_<n>.distcp`, which says one rank. Each worker holds one chunk,
    so chunks are cut smaller than `max_chunk_bytes` where `workers` of them would not fit in
    `memory_bytes`."""
    check_flag("overwrite", overwrite)
    # torch.distributed.checkpoint loads torch: imported by the export that needs it, not with the CLI
    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    if max_chunk_bytes <= 0 or max_file_bytes <= 0:
        raise LayoutError("chunk and file size limits must be positive")
    if workers is not None and workers < 1:
        raise OptionError(f"workers must be at least 1, got {workers}")
    nworkers = max(1, workers or default_workers())
    max_chunk_bytes = chunk_for_memory(memory_bytes, nworkers, max_chunk_bytes)
    require_separate(out_dir, [src])  # also refuses "": an unset variable must not mean the working directory
    out_dir = os.path.abspath(local_dcp_path(out_dir))
    if os.path.islink(out_dir) and os.path.isdir(out_dir):
        # a link to a directory (`latest -> /disk/run`) is kept and its target written, as reshard and
        # export-hf do: swapping the export in for the link itself left the old export at the target
        out_dir = os.path.realpath(out_dir)
    if os.path.lexists(out_dir) and not os.path.isdir(out_dir):
        # as reshard and export-hf: --overwrite replaces a directory's contents, never a file
        raise DestinationExistsError(f"{out_dir} exists and is not a directory; export-dcp writes a directory and "
                                     "never replaces a file (even with --overwrite): move it away or choose another "
                                     "OUT_DIR")
    in_place = os.path.isdir(out_dir) and not _entries(out_dir)
    if os.path.lexists(out_dir) and not in_place and not overwrite:
        raise DestinationExistsError(f"{out_dir} already exists and is not empty; choose another directory or pass "
                                     "--overwrite")
    _remove_leftovers(out_dir)
    ck = open_checkpoint(src, storage_options=storage_options)
    info = ck.user.get(USER_KEY) if isinstance(ck.user.get(USER_KEY), dict) else {}
    prefix = model_prefix if model_prefix is not None else str(info.get("model_prefix", MODEL_PREFIX))
    # non-tensor entries: the original bytes when the checkpoint came from DCP, else the hyperparameters
    carried: dict[str, bytes] = {}
    for key, b64 in (info.get("bytes") or {}).items():
        try:
            carried[key] = base64.b64decode(b64, validate=True)
        except (ValueError, TypeError):
            raise FormatError(f"{ck.url}: user metadata dcp.bytes['{key}'] is not valid base64") from None
    if not carried:
        for fqn, hps in groups_by_param(ck).items():
            for hp, v in (hps or {}).items():
                buf = io.BytesIO()
                torch.save(tuple(v) if hp == "betas" and isinstance(v, list) else v, buf)
                carried[f"{PARAM_GROUPS_PREFIX}{fqn}.{hp}"] = buf.getvalue()
    items: list[_Item] = []
    keys: dict[str, str] = {}
    for name in ck.names():
        key = name_to_dcp_key(name, prefix)
        if key in keys or key in carried:
            raise FormatError(f"tensor '{name}' and '{keys.get(key, key)}' both map to DCP key '{key}'")
        if dcp_key_to_name(key, prefix) != name:  # e.g. extra.model.x: its key model.x reads back as x
            raise FormatError(f"tensor '{name}' would be exported as DCP key '{key}', which import-dcp reads back as "
                              f"'{dcp_key_to_name(key, prefix)}'; rename the tensor or pick another --model-prefix "
                              f"than '{prefix}'")
        keys[key] = name
        m = ck.meta(name)
        isz = itemsize(m.dtype)
        for off, size, fs in plan_chunks(m.shape, isz, max_chunk_bytes):
            n = math.prod(size)
            items.append(_Item(key, name, off, size, fs, n, n * isz))
    total = sum(i.nbytes for i in items)
    if on_plan is not None:
        on_plan(total)
    target = min(max_file_bytes, max(1 << 20, -(-total // nworkers)))
    files: list[list[_Item]] = [[]]
    acc = 0
    for it in items:
        if acc and acc + it.nbytes > target:
            files.append([])
            acc = 0
        files[-1].append(it)
        acc += it.nbytes
    names_of = [f"__0_{i}.distcp" for i in range(len(files))]
    # an empty existing directory may be a mount point, which cannot be replaced by a rename: write
    # straight into it (`.metadata` last, so a reader never sees an incomplete checkpoint)
    tmp = out_dir if in_place else f"{out_dir}.tmp-{uuid.uuid4().hex[:12]}"
    meta_tmp = os.path.join(tmp, f"{METADATA_FILE}.tmp-{uuid.uuid4().hex[:12]}")
    if not in_place:
        try:
            os.makedirs(os.path.dirname(out_dir), exist_ok=True)  # as every other command creates its parents
            os.mkdir(tmp)
        except OSError as e:  # name the destination, not the temporary sibling it is built under
            raise _destination_error(out_dir, e) from None
    # every chunk of a worker in one reused buffer: a fresh tensor per chunk left the freed ones in
    # the thread's malloc arena (4 workers with 8 MiB chunks held 240 MiB exporting 384 MiB, 36 now)
    scratch = ThreadBuffers(max((it.nbytes for it in items), default=0))

    try:
        def write_file(i: int) -> list[tuple[_Item | str, int, int]]:
            done: list[tuple[_Item | str, int, int]] = []
            with open(os.path.join(tmp, names_of[i]), "wb") as f:
                if i == 0:
                    for key, raw in carried.items():
                        pos = f.tell()
                        f.write(raw)
                        done.append((key, pos, len(raw)))
                for it in files[i]:
                    pool.stop_point()  # another file failed, or Ctrl-C: stop between chunks
                    t = scratch.take_tensor(it.numel, torch_dtype(ck.meta(it.name).dtype)).view(it.sizes)
                    if it.numel:
                        ck.read_flat(it.name, it.flat_start, it.flat_start + it.numel, out=t.reshape(-1))
                    pos = f.tell()
                    torch.save(t, f)
                    done.append((it, pos, f.tell() - pos))
                    if progress is not None:
                        progress(it.nbytes)
                f.flush()
                os.fsync(f.fileno())
            return done

        with StoppablePool(min(nworkers, len(files))) as pool:
            results = list(pool.map(write_file, range(len(files))))
        sd_meta: dict[str, Any] = {}
        storage: dict[Any, Any] = {}
        chunk_index: dict[str, int] = {}
        for name in ck.names():
            m = ck.meta(name)
            sd_meta[name_to_dcp_key(name, prefix)] = TensorStorageMetadata(
                properties=TensorProperties(dtype=torch_dtype(m.dtype)), size=torch.Size(m.shape), chunks=[])
        for i, done in enumerate(results):
            for entry, pos, length in done:
                if isinstance(entry, str):
                    sd_meta[entry] = BytesStorageMetadata()
                    storage[MetadataIndex(entry)] = _StorageInfo(names_of[i], pos, length)
                    continue
                tsm = sd_meta[entry.key]
                j = chunk_index.get(entry.key, 0)
                chunk_index[entry.key] = j + 1
                tsm.chunks.append(ChunkStorageMetadata(offsets=torch.Size(entry.offsets), sizes=torch.Size(entry.sizes)))
                storage[MetadataIndex(entry.key, entry.offsets, j)] = _StorageInfo(names_of[i], pos, length)
        saved_paths = info.get("planner_data") or {}
        planner_data: dict[str, Any] = {k: tuple(saved_paths[k]) if k in saved_paths else default_planner_path(k)
                                        for k in sd_meta}
        if RECORD_KEY not in sd_meta:  # what the export came from, for import-dcp's defaults
            planner_data[RECORD_KEY] = export_record_value(ck, keys, prefix)
        md = Metadata(state_dict_metadata=sd_meta, planner_data=planner_data, storage_data=storage,
                      storage_meta=StorageMeta(checkpoint_id=out_dir, save_id=str(uuid.uuid4())),
                      version=CURRENT_DCP_VERSION)
        with open(meta_tmp, "wb") as f:
            pickle.dump(md, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(meta_tmp, os.path.join(tmp, METADATA_FILE))
        fsync_dir(tmp)
        if not in_place:
            _swap_in(tmp, out_dir)
    except BaseException as e:
        if in_place:  # the directory was empty: what is in it now is this export's
            for name in [*names_of, os.path.basename(meta_tmp), METADATA_FILE]:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(tmp, name))
        else:
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) and str(e.filename or "").startswith(tmp):
            raise _destination_error(out_dir, e) from None
        raise
    return ExportSummary(source=ck.url, destination=out_dir, tensors=len(keys), non_tensor_entries=len(carried),
                         chunks=len(items), files=len(files), tensor_bytes=total, model_prefix=prefix,
                         warnings=optimizer_gaps(ck.names(), carried) + _left_behind(ck))


#: user-metadata keys that ragckpt's own converters and resharder write; the rest are the user's
_OWN_USER_KEYS = frozenset({USER_KEY, PARAM_GROUPS_USER_KEY, "hf", "ragckpt.reshard"})


def _left_behind(ck: Checkpoint) -> list[str]:
    """What a DCP export cannot hold, said rather than dropped: per-rank extras (RNG states, data
    positions: DCP has no per-rank objects) and the user's own metadata keys (`save_shard(user=...)`,
    `save_state_dict(user=...)`), which are not entries of any state dict."""
    out = []
    mine = sorted(k for k in ck.user if k not in _OWN_USER_KEYS)
    if mine:
        shown = ", ".join(mine[:5]) + (", ..." if len(mine) > 5 else "")
        out.append(f"user metadata ({shown}) is not in the export, which holds state-dict entries only; read it "
                   f"with ragckpt.open(SRC).user")
    with_extras = ck.ranks_with_extras()
    if with_extras:
        out.append(f"per-rank extras of {with_extras} rank(s) (RNG states, data positions) are not in the export; "
                   f"read them with ragckpt.open(SRC).extra(rank)")
    return out


def _destination_error(out_dir: str, e: OSError) -> DestinationError:
    """A failure to write the export, worded with the destination the user named (the work happens
    under a temporary sibling, whose name means nothing to them)."""
    where = out_dir if os.path.isdir(out_dir) else os.path.dirname(out_dir)
    if isinstance(e, PermissionError):
        reason, hint = "permission denied", f"check the permissions of {where}"
    else:
        reason, hint = e.strerror or str(e), f"check {where} (free space, file system)"
    return DestinationError(f"cannot write the DCP export to {out_dir}: {reason}; {hint}, or choose another directory")



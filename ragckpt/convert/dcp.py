"""PyTorch Distributed Checkpoint (DCP) <-> ragckpt, streamed, without a process group.

* `import_dcp(dcp_dir, dst)` reads DCP's `.metadata` (no `torch.distributed` initialisation, no
  pickle code execution) and assembles every rank buffer of the new ragckpt checkpoint chunk by chunk:
  a flat element range of a tensor maps to at most `2d-1` N-D boxes, each box is intersected with the
  saved DCP chunks (boxes) and exactly the overlapping bytes are read from the `.distcp` files
  (`pread` on local files; ranged GETs through ragckpt's stores for `s3://` and other URLs).
  Memory stays at one writer chunk per worker, whatever the checkpoint size.
* `export_dcp(src, out_dir)` writes `.distcp` files and a `.metadata` that stock
  `torch.distributed.checkpoint.load` reads at any world size (it reshards by box overlap). Every
  tensor is cut into row boxes of at most `max_chunk_bytes` (sub-row boxes for rows larger than that),
  each one read with `Checkpoint.read_flat` and serialised exactly as DCP's own writer does
  (`torch.save` of the chunk), so memory stays at one chunk per worker. The directory appears
  atomically (temporary sibling, fsync, rename). Its `.metadata` records the source's world size and
  layout (`ExportRecord`, in `planner_data`, which torch's loaders ignore), so importing an export
  back rebuilds the same shape without flags.

Key mapping (see docs/CONVERT_DCP.md): DCP `model.<fqn>` <-> ragckpt `<fqn>`; `optim.*` keys are
identical on both sides (DCP's flattened optimizer layout is the ragckpt naming convention); any other
tensor key `<k>` <-> `extra.<k>`. Non-tensor DCP entries (optimizer hyperparameters, user objects) are
carried byte for byte in the user metadata (`dcp.bytes`), with a readable per-parameter view under
`optim.param_groups`.
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import errno
import io
import math
import os
import pickle
import re
import shutil
import stat
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np

from ragckpt.args import check_flag
from ragckpt.checkpoint.manifest import DEFAULT_MAX_CHUNK_BYTES, MAX_WORLD_SIZE, brief
from ragckpt.checkpoint.reader import Checkpoint
from ragckpt.checkpoint.reader import open as open_checkpoint
from ragckpt.checkpoint.writer import (
    DEFAULT_MEMORY_BYTES,
    check_memory_budget,
    check_write_options,
    chunk_for_memory,
    default_workers,
    segment_fill,
    write_streaming,
)
from ragckpt.convert import DEFAULT_EXPORT_CHUNK_BYTES
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
from ragckpt.errors import (
    DestinationError,
    DestinationExistsError,
    FormatError,
    LayoutError,
    OptionError,
    RagckptError,
    StorageError,
)
from ragckpt.format.dtypes import dtype_name, itemsize, torch_dtype
from ragckpt.format.intervals import flat_range_to_boxes
from ragckpt.format.names import OPTIM_STATE_PREFIX, RESERVED_PREFIXES
from ragckpt.format.runs import copy_runs
from ragckpt.planner.planner import GranularitySpec
from ragckpt.planner.state import MAX_NUMEL, PLANNED_KINDS, CheckpointLayout
from ragckpt.reshard.plan import inferred_granularity
from ragckpt.storage.checksum import DEFAULT_BLOCK_BYTES
from ragckpt.storage.destination import RENAME_REFUSED, require_separate
from ragckpt.storage.direct import ThreadBuffers
from ragckpt.storage.store import Buffer, LocalStore, fsync_dir, local_path, open_store
from ragckpt.workpool import StoppablePool

if TYPE_CHECKING:
    import torch
else:  # the CLI imports this module for its commands; torch comes in when one runs (see ragckpt.lazy)
    from ragckpt.lazy import torch

MODEL_PREFIX = "model."
OPTIM_PREFIX = "optim."
EXTRA_PREFIX = "extra."
PARAM_GROUPS_PREFIX = "optim.param_groups."
USER_KEY = "dcp"
PARAM_GROUPS_USER_KEY = "optim.param_groups"
MAX_CARRIED_BYTES = 16 << 20  # non-tensor entries ride in the JSON manifest: keep them small
DEFAULT_EXPORT_FILE_BYTES = 1 << 30
_RANK_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")
#: the `planner_data` key of export-dcp's record of its source (`ExportRecord`): not a state-dict key
#: any save produces; an export whose own tensors use it goes without the record
RECORD_KEY = "__ragckpt_export__"
RECORD_FORMAT = 1
_RECORD_POLICIES = ("whole", "element", "row")  # what `inferred_granularity` yields
_FD_CACHE_MAX = 256
# object-store sources: record headers are fetched this many records per batch (at most
# 2 x 4 KiB or 16 KiB each, so a batch holds a few MiB), nearby windows merged when at most
# _COALESCE_GAP_BYTES apart into requests of at most _COALESCE_MAX_BYTES; small records fetched whole
# are kept for their element reads up to _WHOLE_CACHE_BYTES in all
_HEADER_BATCH = 1024
_COALESCE_GAP_BYTES = 16 << 10
_COALESCE_MAX_BYTES = 4 << 20
_WHOLE_CACHE_BYTES = 64 << 20


# -- key mapping -----------------------------------------------------------------------------------

def detect_model_prefix(tensor_keys: list[str]) -> str:
    """`model.` when the save used the `{"model": ..., "optim": ...}` convention, else "" (a bare
    `model.state_dict()` was saved and its keys are already parameter names). Keys under `model.`
    mean the convention unless every other key (optimizer keys aside) is a parameter of its own
    (`lm_head.weight`, `score.bias`): that is a bare Hugging Face model, whose names start with
    `model.` too (`model.embed_tokens.weight`). Other top-level entries (`rng`, `tp.col`,
    `optimizer.*`) sit beside a wrapped model. Flattened optimizer state settles it first where there
    is any: `optim.state.<fqn>.<key>` names each parameter as the model calls it, so its FQNs are
    either the keys themselves (a bare model) or the keys without `model.` (the convention; an EMA
    copy saved beside it as `ema.*` would otherwise pass for a bare model's own parameters).
    `import_dcp(model_prefix=...)` overrides the guess."""
    if not any(k.startswith(MODEL_PREFIX) for k in tensor_keys):
        return ""
    keys = set(tensor_keys)
    state = "optim.state."
    fqns = {k[len(state):].rsplit(".", 1)[0] for k in tensor_keys if k.startswith(state) and "." in k[len(state):]}
    bare = sum(f in keys for f in fqns)
    wrapped = sum(MODEL_PREFIX + f in keys for f in fqns)
    if bare != wrapped:
        return "" if bare > wrapped else MODEL_PREFIX
    others = [k for k in tensor_keys if not k.startswith((MODEL_PREFIX, OPTIM_PREFIX))]
    return "" if others and all(k.endswith((".weight", ".bias")) for k in others) else MODEL_PREFIX


def dcp_key_to_name(key: str, model_prefix: str) -> str:
    """ragckpt tensor name of a DCP tensor key (injective; `name_to_dcp_key` inverts it)."""
    if key.startswith(OPTIM_PREFIX):
        return key
    if key.startswith(model_prefix):
        rest = key[len(model_prefix):]
        if rest and not rest.startswith(RESERVED_PREFIXES):
            return rest
    return EXTRA_PREFIX + key


def name_to_dcp_key(name: str, model_prefix: str) -> str:
    if name.startswith(OPTIM_PREFIX):
        return name
    if name.startswith(EXTRA_PREFIX):
        return name[len(EXTRA_PREFIX):]
    return model_prefix + name


def jsonable(v: Any) -> Any:
    """A JSON view of a decoded hyperparameter, or raises TypeError (tuples become lists)."""
    if v is None or isinstance(v, bool | int | str):
        return v
    if isinstance(v, float):
        if not math.isfinite(v):
            raise TypeError("non-finite float")
        return v
    if isinstance(v, list | tuple):
        return [jsonable(x) for x in v]
    raise TypeError(type(v).__name__)


def param_groups_view(decoded: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """`{param_fqn: {hparam: value}}` from decoded `optim.param_groups.*` entries, for both DCP layouts:
    flattened (`optim.param_groups.<fqn>.<hp>`, what `flatten_optimizer_state_dict=True` saves) and
    nested (`optim.param_groups.<i>.<hp>` with `optim.param_groups.<i>.params` listing the fqns)."""
    groups: dict[str, dict[str, Any]] = {}
    for key, v in decoded.items():
        if key.startswith(PARAM_GROUPS_PREFIX):
            mid, _, hp = key[len(PARAM_GROUPS_PREFIX):].rpartition(".")
            if mid and hp:
                groups.setdefault(mid, {})[hp] = v
    out: dict[str, dict[str, Any]] = {}
    for mid, hps in groups.items():
        params = hps.get("params")
        if isinstance(params, list) and all(isinstance(p, str) for p in params):
            rest = {k: v for k, v in hps.items() if k != "params"}
            for p in params:
                out.setdefault(p, {}).update(rest)
        else:
            out.setdefault(mid, {}).update(hps)
    return out


def groups_by_param(ck: Any) -> dict[str, dict]:
    """Checkpoint `ck`'s `optim.param_groups` user metadata as {param: {hyperparameter: value}}: as
    ENGINE.md has it, or torch's own form, a list of groups each naming its parameters in `params`.
    Anything else is refused in one line (the hyperparameters could not be restored or exported)."""
    groups = ck.user.get(PARAM_GROUPS_USER_KEY) or {}
    if isinstance(groups, dict) and all(isinstance(h, dict) for h in groups.values()):
        return groups
    if isinstance(groups, list) and all(
            isinstance(g, dict) and isinstance(g.get("params"), list) and all(isinstance(p, str) for p in g["params"])
            for g in groups):
        return {p: {k: v for k, v in g.items() if k != "params"} for g in groups for p in g["params"]}
    raise FormatError(f"{ck.url}: user metadata '{PARAM_GROUPS_USER_KEY}' is neither the {{param: {{hyperparameter: "
                      "value}} mapping nor a list of groups with 'params' lists (torch's optimizer param_groups), "
                      "so the optimizer's hyperparameters cannot be read; see docs/ENGINE.md")


def dcp_user_metadata(*, model_prefix: str, world_size: int | None, carried: dict[str, str],
                      decoded: dict[str, Any], planner_data: dict[str, list], **more: Any) -> dict[str, Any]:
    """The user metadata of a checkpoint made from a DCP-style state dict (by import-dcp or
    `save_state_dict`): the `dcp` record export-dcp reads back (the non-tensor entries' bytes,
    base64, and where each key sat in the nested state dict) and the readable `optim.param_groups`
    view of the hyperparameters. `more`: further fields of the record (the source, DCP's version)."""
    user: dict[str, Any] = {USER_KEY: {**more, "world_size": world_size, "model_prefix": model_prefix,
                                       "bytes": carried, "planner_data": planner_data}}
    groups = param_groups_view(decoded)
    if groups:
        user[PARAM_GROUPS_USER_KEY] = groups
    return user


# -- the export record -----------------------------------------------------------------------------

@dataclass(frozen=True)
class ExportRecord:
    """What an export came from, kept in its DCP `.metadata` so that import-dcp can rebuild the same
    checkpoint shape without flags: the ragckpt checkpoint's world size, its layout kind, for a
    ragged layout the tensors planned with a granularity other than row (by DCP key), and the model
    prefix the export put before parameter names (so that import maps every key back to the name it
    came from, where guessing could take `extra.ema.weight`'s key `ema.weight` for a parameter).
    Each field is None (empty) when absent or not valid, and then import falls back to its usual
    defaults."""

    world_size: int | None = None
    layout: str | None = None
    granularity: dict[str, str] = field(default_factory=dict)
    model_prefix: str | None = None


def export_record_value(ck: Any, keys: dict[str, str], model_prefix: str) -> dict[str, Any]:
    """The record of checkpoint `ck` exported with `model_prefix` (`keys`: DCP key -> ragckpt name)
    as plain data (ints, strings, dicts: nothing DCP's or ragckpt's metadata unpickler would
    refuse). Granularity is the per-tensor policy reshard infers from a ragged layout (`rows:K`
    blocks are not recorded in the format). The source's URL is left out: an export is often
    shared, and a URL may carry a host or user name."""
    gran: dict[str, str] = {}
    if ck.kind == "ragged":
        key_of = {name: key for key, name in keys.items()}
        for b in ck.layout.buffers:
            for name, policy in inferred_granularity(ck.layout.layouts[b.layout], b.tensors).items():
                if policy != "row" and name in key_of:
                    gran[key_of[name]] = policy
    return {"format": RECORD_FORMAT, "world_size": ck.world_size, "layout": ck.kind, "granularity": gran,
            "model_prefix": model_prefix}


def read_export_record(metadata: Any) -> ExportRecord | None:
    """The record an export left in DCP `metadata.planner_data`, or None (an export by an older
    ragckpt, or any other DCP save). The record lives under a key that names no entry of the state
    dict, where torch never looks: its loaders read `planner_data[k]` only for keys `k` of
    `state_dict_metadata`. Fields that do not validate are dropped, not trusted."""
    pd = getattr(metadata, "planner_data", None)
    value = pd.get(RECORD_KEY) if isinstance(pd, dict) else None
    if not isinstance(value, dict) or value.get("format") != RECORD_FORMAT:  # an entry's path is a tuple
        return None
    w = value.get("world_size")
    world_size = w if isinstance(w, int) and not isinstance(w, bool) and 1 <= w <= MAX_WORLD_SIZE else None
    layout = value.get("layout") if value.get("layout") in PLANNED_KINDS else None
    gran = value.get("granularity")
    granularity = {k: v for k, v in gran.items() if isinstance(k, str) and v in _RECORD_POLICIES} \
        if isinstance(gran, dict) else {}
    p = value.get("model_prefix")
    prefix = p if isinstance(p, str) and not p.startswith(RESERVED_PREFIXES) else None
    return ExportRecord(world_size, layout, granularity, prefix)


# -- the DCP side ----------------------------------------------------------------------------------

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


@dataclass(frozen=True)
class DcpChunk:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    path: str  # relative to the checkpoint directory
    start: int
    length: int

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


@dataclass
class DcpTensor:
    key: str
    shape: tuple[int, ...]
    dtype: str
    chunks: list[DcpChunk]
    _offs: np.ndarray = field(init=False, repr=False)
    _ends: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        d = len(self.shape)
        live = [c for c in self.chunks if c.numel > 0]
        self.chunks = live
        self._offs = np.asarray([c.offsets for c in live], dtype=np.int64).reshape(len(live), d)
        self._ends = self._offs + np.asarray([c.sizes for c in live], dtype=np.int64).reshape(len(live), d)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _is_int(v: object) -> bool:
    return isinstance(v, int | np.integer) and not isinstance(v, bool)


def _dims(value: object, ndim: int | None = None) -> tuple[int, ...] | None:
    """`value` (a torch.Size or sequence from DCP metadata) as a shape, offsets or sizes: non-negative
    ints under 2**62 (`ndim` of them when given), else None: damaged metadata."""
    if not isinstance(value, list | tuple) or (ndim is not None and len(value) != ndim):
        return None
    if not all(_is_int(x) and 0 <= x < MAX_NUMEL for x in value):
        return None
    return tuple(int(x) for x in value)


def _shown(value: object) -> str:
    """`value` for an error message; a torch.Size holding 2**70 cannot even be repr'ed."""
    try:
        return brief(list(value) if isinstance(value, list | tuple) else value)
    except (ValueError, OverflowError):
        return f"a {type(value).__name__} that cannot be shown"


def _check_tiling(t: DcpTensor, where: str) -> None:
    """DCP's saver guarantees the chunks tile the tensor exactly; a file that breaks that is corrupt."""
    shape = np.asarray(t.shape, dtype=np.int64)
    if len(t.chunks) and ((t._offs < 0).any() or (t._ends > shape).any()):
        raise FormatError(f"{where}: tensor '{t.key}' has a chunk outside its shape {t.shape}")
    total = sum(c.numel for c in t.chunks)
    if total != t.numel:
        raise FormatError(f"{where}: the chunks of tensor '{t.key}' cover {total} of its {t.numel} elements; "
                          "the checkpoint is incomplete")
    n, d = t._offs.shape
    if n <= 1 or d == 0:
        return
    full_tail = (t._offs[:, 1:] == 0).all() and (t._ends[:, 1:] == shape[1:]).all()
    if full_tail:  # row boxes (FSDP2 Shard(0)): sorted intervals on dim 0
        order = np.argsort(t._offs[:, 0], kind="stable")
        if (t._offs[order][1:, 0] < t._ends[order][:-1, 0]).any():
            raise FormatError(f"{where}: chunks of tensor '{t.key}' overlap; the checkpoint is corrupt")
        return
    for i in range(n - 1):  # general boxes: vectorised pairwise test, one row of pairs at a time
        lo = np.maximum(t._offs[i], t._offs[i + 1:])
        hi = np.minimum(t._ends[i], t._ends[i + 1:])
        if (hi > lo).all(axis=1).any():
            raise FormatError(f"{where}: chunks of tensor '{t.key}' overlap; the checkpoint is corrupt")


def _box_runs(shape: tuple[int, ...], off: np.ndarray, size: np.ndarray, local_off: np.ndarray,
              local_shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, int]:
    """Contiguous runs of box (off, size) in the global flat space and in a chunk's flat space
    (the box sits at `local_off` inside a chunk of `local_shape`). Runs merge the trailing dims the box
    spans fully in the global shape, which it then also spans fully in the chunk."""
    d = len(shape)
    gstr = np.ones(d, dtype=np.int64)
    lstr = np.ones(d, dtype=np.int64)
    for i in range(d - 2, -1, -1):
        gstr[i] = gstr[i + 1] * shape[i + 1]
        lstr[i] = lstr[i + 1] * local_shape[i + 1]
    k = d - 1
    run = int(size[k])
    while k > 0 and int(off[k]) == 0 and int(size[k]) == shape[k]:
        k -= 1
        run *= int(size[k])
    g = np.array([int((off * gstr).sum())], dtype=np.int64)
    loc = np.array([int((local_off * lstr).sum())], dtype=np.int64)
    for i in range(k - 1, -1, -1):
        steps = np.arange(int(size[i]), dtype=np.int64)
        g = (steps[:, None] * gstr[i] + g[None, :]).reshape(-1)
        loc = (steps[:, None] * lstr[i] + loc[None, :]).reshape(-1)
    return g, loc, run


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


# -- import ----------------------------------------------------------------------------------------

@dataclass
class ImportSummary:
    source: str
    destination: str
    saved_world_size: int | None
    world_size: int
    layout: str
    tensors: int
    non_tensor_entries: int
    tensor_bytes: int
    model_prefix: str
    names: dict[str, str]  # DCP key -> ragckpt name
    #: where `world_size` came from: "option", "export record", "file names" or "default"
    world_size_from: str
    #: what the user should know but that did not stop the import (one line each)
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        d = dict(self.__dict__)
        d["names"] = dict(self.names)
        d["notes"] = list(self.notes)
        return d


def choose_world_size(src: DcpCheckpoint, world_size: int | None) -> tuple[int, str]:
    """(world size, where it came from) for importing `src`: `world_size` when given, else what an
    export recorded of its source, else the save's own world size from its file names. When none
    of those is known and no tensor holds an element, the world size cannot change any data (every
    rank buffer is empty whatever it is), so 1 is chosen rather than refusing, and the caller says
    so in a note; with elements to place, guessing would silently pick the layout, so it is refused."""
    if world_size is not None:
        return world_size, "option"
    rec = src.export_record
    if rec is not None and rec.world_size is not None:
        return rec.world_size, "export record"
    saved = src.saved_world_size
    if saved is not None:
        return saved, "file names"
    if not any(t.numel for t in src.tensors.values()):
        return 1, "default"
    raise LayoutError(f"{src.directory}: the save's world size cannot be recovered from its file names; "
                      "pass --world-size")


def choose_layout(src: DcpCheckpoint, layout: str | None, granularity: GranularitySpec | None,
                  names: dict[str, str]) -> tuple[str, GranularitySpec]:
    """(layout kind, granularity) for importing `src`: the options when given, else what an export
    recorded of its source (its kind and, for ragged, the per-tensor granularity, mapped to this
    import's tensor names), else ragged with row granularity."""
    rec = src.export_record
    if layout is None and granularity is not None:
        layout = "ragged"  # a planner block says which layout is meant (as on the command line)
    kind = layout if layout is not None else (rec.layout if rec is not None and rec.layout else "ragged")
    if granularity is not None:
        return kind, granularity
    if kind == "ragged" and rec is not None and rec.layout == "ragged" and rec.granularity:
        return kind, {names[k]: g for k, g in rec.granularity.items() if k in names}
    return kind, "row"


def choose_model_prefix(src: DcpCheckpoint, model_prefix: str | None) -> str:
    """The prefix of model keys in `src`: `model_prefix` when given, else the one an export recorded
    (exactly what it put before each name), else a guess from the keys (`detect_model_prefix`)."""
    if model_prefix is not None:
        return model_prefix
    rec = src.export_record
    if rec is not None and rec.model_prefix is not None:
        return rec.model_prefix
    return detect_model_prefix(list(src.tensors))


def decode_bytes(raw: bytes) -> Any:
    """A non-tensor DCP entry is `torch.save(obj)`; decode it with torch's safe (weights-only) loader."""
    return torch.load(io.BytesIO(raw), weights_only=True)


def import_dcp(
    dcp_dir: str,
    dst: str,
    *,
    world_size: int | None = None,
    layout: str | None = None,
    granularity: GranularitySpec | None = None,
    overwrite: bool = False,
    workers: int | None = None,
    memory_bytes: int = DEFAULT_MEMORY_BYTES,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
    storage_options: dict | None = None,
    progress: Callable[[int], None] | None = None,
    on_plan: Callable[[int], None] | None = None,
    model_prefix: str | None = None,
) -> ImportSummary:
    """Convert the DCP checkpoint in `dcp_dir` into a committed ragckpt checkpoint at `dst` for
    `world_size` ranks with `layout` and `granularity`. Their defaults come from what export-dcp
    recorded when `dcp_dir` is one of its exports (the source checkpoint's world size, layout kind and
    granularity), else the save's world size (1 when unknown and every tensor is empty, with a note),
    ragged and row (`choose_world_size`, `choose_layout`). `dcp_dir` is a local directory or any URL the
    stores support (`s3://bucket/prefix`, as torch's fsspec writer saves it); `storage_options` apply
    to both sides. `on_plan(total_bytes)` is called once the layout is known (for progress bars);
    `progress(n)` as bytes are written. `dst` must not overlap `dcp_dir`, and one that holds anything
    is refused unless `overwrite`. About `memory_bytes` of data is in flight, whatever the checkpoint's
    size: it sets the destination chunk each worker fills (at most `max_chunk_bytes`). Options are
    checked before the destination is touched, so bad input leaves nothing behind."""
    check_flag("overwrite", overwrite)
    if world_size is not None and world_size <= 0:
        raise LayoutError(f"world size must be positive, got {world_size}")
    if workers is not None and workers < 1:
        raise OptionError(f"workers must be at least 1, got {workers}")
    check_memory_budget(memory_bytes)
    check_write_options(None, DEFAULT_BLOCK_BYTES, max_chunk_bytes)  # before the budget can hide a bad value
    with DcpCheckpoint(dcp_dir, storage_options) as src:
        W, w_from = choose_world_size(src, world_size)
        rec = src.export_record
        saved_w = rec.world_size if rec is not None and rec.world_size is not None else src.saved_world_size
        notes = []
        if w_from == "default":
            notes.append(f"{src.directory}: the save's world size is unknown and no tensor holds an element, so "
                         "it changes no data; imported for 1 rank (pass --world-size to choose another)")
        prefix = choose_model_prefix(src, model_prefix)
        model_keys = sorted(k for k in src.tensors if not k.startswith(OPTIM_PREFIX))
        if model_prefix and model_keys and not any(k.startswith(model_prefix) for k in model_keys):
            # every tensor would become an extra.* entry: almost surely a typo
            raise OptionError(f"model prefix '{prefix}' matches none of the {len(model_keys)} model tensor keys in "
                              f"{src.directory} (e.g. '{model_keys[0]}'); give the prefix those keys start with, "
                              "'' for none, or leave --model-prefix out to have it guessed")
        names = {k: dcp_key_to_name(k, prefix) for k in src.tensors}
        layout, granularity = choose_layout(src, layout, granularity, names)
        carried: dict[str, str] = {}
        decoded: dict[str, Any] = {}
        total = 0
        for key, info in src.bytes_entries.items():  # sizes from the metadata: refuse before reading
            total += int(info.length)
            if total > MAX_CARRIED_BYTES:
                raise FormatError(f"{src.directory}: non-tensor entries exceed {MAX_CARRIED_BYTES >> 20} MiB "
                                  f"(at '{key}'); import-dcp carries them in the manifest - save large state as "
                                  "tensors instead")
        for key, raw in src.read_all_bytes().items():
            carried[key] = base64.b64encode(raw).decode("ascii")
            try:
                decoded[key] = jsonable(decode_bytes(raw))
            except Exception:  # noqa: BLE001 - an opaque object is still carried byte for byte
                pass
        planner = {k: list(v) for k, v in src.planner_data.items()  # paths only (an export record is a dict)
                   if isinstance(v, tuple | list) and all(isinstance(x, str | int) for x in v)}
        user = dcp_user_metadata(model_prefix=prefix, world_size=saved_w, carried=carried, decoded=decoded,
                                 planner_data=planner, source=src.directory,
                                 version=getattr(src.metadata, "version", None))
        by_name = {names[k]: src.tensors[k] for k in src.tensors}
        src.check_records(workers)
        lay = CheckpointLayout.build({n: (t.shape, t.dtype) for n, t in by_name.items()}, W, layout, granularity)
        if on_plan is not None:
            on_plan(lay.total_bytes())

        def read_flat(name: str, a: int, b: int, out: torch.Tensor) -> None:
            src.read_flat(by_name[name].key, a, b, out)

        nworkers = max(1, min(workers or default_workers(), W))
        scratch = ThreadBuffers()
        write_streaming(dst, lay, lambda bi, r: segment_fill(lay, bi, r, read_flat, scratch), user=user,
                        overwrite=overwrite, storage_options=storage_options,
                        max_chunk_bytes=chunk_for_memory(memory_bytes, nworkers, max_chunk_bytes),
                        workers=workers, progress=progress, sources=[src.directory])
        return ImportSummary(
            source=src.directory, destination=open_store(dst, storage_options).url, saved_world_size=saved_w, world_size=W, layout=layout,
            tensors=len(by_name), non_tensor_entries=len(carried),
            tensor_bytes=sum(t.numel * itemsize(t.dtype) for t in by_name.values()),
            model_prefix=prefix, names=names, world_size_from=w_from, notes=notes,
        )


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


def default_planner_path(key: str) -> tuple[str, ...]:
    """How DCP's flattening would have named `key`: `(top-level key, rest)`, as a save of
    `{"model": model_sd, "optim": flattened_optim_sd}` records it."""
    head, sep, rest = key.partition(".")
    return (head, rest) if sep and rest else (key,)


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


def optimizer_gaps(names: list[str], non_tensor_keys: Mapping[str, bytes] | Iterable[str]) -> list[str]:
    """What `set_optimizer_state_dict` / `torch.optim.Optimizer.load_state_dict` will miss in an
    export: torch's Adam keeps a `step` per parameter beside its moments, and every optimizer
    needs `param_groups`. A training engine that saved only the moments (with the step in user
    metadata) exports fine, but FSDP2's load then fails with "Missing key ... .step".
    `non_tensor_keys` maps each non-tensor key to its `torch.save` bytes where they are known: the
    groups of a nested optimizer state dict (FSDP2's default) are keyed by group index and name
    their parameters in `optim.param_groups.<i>.params`, which only the bytes say."""
    states: dict[str, set[str]] = {}
    model = set(n for n in names if not n.startswith(OPTIM_PREFIX))
    for n in names:
        if n.startswith(OPTIM_STATE_PREFIX):
            param, _, key = n[len(OPTIM_STATE_PREFIX):].rpartition(".")
            if param in model:
                states.setdefault(param, set()).add(key)
    out = []
    no_step = sorted(p for p, keys in states.items() if "step" not in keys and keys & {"exp_avg", "exp_avg_sq"})
    if no_step:
        out.append(f"optimizer state of {len(no_step)} parameter(s) has moments but no step (e.g. "
                   f"'{OPTIM_STATE_PREFIX}{no_step[0]}.step'); torch's Adam expects one per parameter, so save it "
                   "as a 0-d tensor beside the moments")
    groups: dict[str, set[str]] = {}
    for k in non_tensor_keys:
        if k.startswith(PARAM_GROUPS_PREFIX):
            param, _, hp = k[len(PARAM_GROUPS_PREFIX):].rpartition(".")
            groups.setdefault(param, set()).add(hp)
    if isinstance(non_tensor_keys, Mapping):
        for param, hps in _nested_groups(non_tensor_keys).items():
            groups.setdefault(param, set()).update(hps)
    if states and not groups:
        out.append("no optim.param_groups: an optimizer cannot load the state without them; record "
                   f"user['{PARAM_GROUPS_USER_KEY}'] = {{param: {{'lr': ..., 'betas': [...], ...}}}} at save")
    adam = sorted(p for p, keys in states.items() if keys & {"exp_avg", "exp_avg_sq"})
    if adam and groups:
        # dcp.load asks for every hyperparameter the live optimizer's groups hold: with one missing
        # it fails with "Missing key in checkpoint state_dict: optim.param_groups.<p>.<hp>"
        need = adam_group_keys()
        lacking = [(p, sorted(need - groups.get(p, set()))) for p in adam if need - groups.get(p, set())]
        if lacking:
            p, miss = lacking[0]
            out.append(f"optim.param_groups of {len(lacking)} parameter(s) with Adam moments lack hyperparameters "
                       f"torch's Adam and AdamW keep (for '{p}': {', '.join(miss)}), so dcp.load into them fails "
                       f"with \"Missing key ... {PARAM_GROUPS_PREFIX}{p}.{miss[0]}\"; record every key of the "
                       "optimizer's groups (optimizer.param_groups[i] without 'params') at save")
    return out


def _nested_groups(entries: Mapping[str, bytes]) -> dict[str, set[str]]:
    """{param: its group's hyperparameters} of the groups of a nested optimizer state dict
    (`optim.param_groups.<i>.<hp>` and `optim.param_groups.<i>.params`, a list of parameter
    names): `dcp.load` into a nested state dict asks for its groups by index, so each parameter
    there has what its group holds. A `params` entry that is no list of names is left unjudged."""
    by_group: dict[str, set[str]] = {}
    for k in entries:
        if k.startswith(PARAM_GROUPS_PREFIX):
            g, _, hp = k[len(PARAM_GROUPS_PREFIX):].rpartition(".")
            if g.isdigit():
                by_group.setdefault(g, set()).add(hp)
    out: dict[str, set[str]] = {}
    for g, hps in by_group.items():
        if "params" not in hps:
            continue
        try:
            params = decode_bytes(entries[f"{PARAM_GROUPS_PREFIX}{g}.params"])
        except Exception:  # noqa: BLE001 - the weights-only loader raises several kinds; then say nothing of it
            continue
        if isinstance(params, list | tuple) and all(isinstance(p, str) for p in params):
            for p in params:
                out.setdefault(p, set()).update(hps - {"params"})
    return out


def adam_group_keys() -> set[str]:
    """The hyperparameters every group of torch's Adam and AdamW holds in the installed torch (11 in
    torch 2.13, `lr` to `decoupled_weight_decay`): what `dcp.load` into either will ask for."""
    p = [torch.zeros(1, requires_grad=True)]
    adam, adamw = (set(cls(p).param_groups[0]) - {"params"} for cls in (torch.optim.Adam, torch.optim.AdamW))
    return adam & adamw


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


def _entries(directory: str) -> list[str]:
    """The entries of `directory` that belong to its user: a mount point's `lost+found` is the file
    system's, so a fresh mount point counts as empty."""
    names = os.listdir(directory)
    if os.path.ismount(directory):
        names = [n for n in names if n != "lost+found"]
    return names


def _leftover_pattern(out_dir: str) -> re.Pattern[str]:
    """The sibling names an export into `out_dir` works under: `<name>.tmp-<hex>` while it writes,
    `<name>.old-<hex>` for the tree it replaces."""
    return re.compile(re.escape(os.path.basename(out_dir)) + r"\.(tmp|old)-[0-9a-f]{12}")


def _remove_leftovers(out_dir: str) -> None:
    """Delete the sibling trees a killed earlier export into `out_dir` left (exact names only,
    directories only: nothing a user made)."""
    parent, pattern = os.path.dirname(out_dir), _leftover_pattern(out_dir)
    if not os.path.isdir(parent):  # created later, once the source has been read
        return
    for name in os.listdir(parent):
        path = os.path.join(parent, name)
        if pattern.fullmatch(name) and os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)


try:  # renameat2(2), glibc 2.28+
    _renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
except (OSError, AttributeError):  # pragma: no cover - other C libraries
    _renameat2 = None


def _exchange(a: str, b: str) -> bool:
    """Swap two paths atomically (renameat2 RENAME_EXCHANGE); False where the kernel, the C library
    or the file system cannot."""
    if _renameat2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if _renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), b)


def _swap_in(tmp: str, out_dir: str) -> None:
    """Put the finished tree `tmp` at `out_dir`: a rename when `out_dir` is absent; otherwise the two
    are exchanged atomically and the old tree deleted (where the exchange is not available, the old
    tree is renamed aside and the new one renamed in). Where `out_dir` cannot be renamed (a mount
    point), its contents are replaced in place instead."""
    parent = os.path.dirname(out_dir)
    if not os.path.lexists(out_dir):
        os.rename(tmp, out_dir)
        fsync_dir(parent)
        return
    old = f"{out_dir}.old-{uuid.uuid4().hex[:12]}"
    try:
        if _exchange(tmp, out_dir):
            old = tmp  # `tmp` now holds the old tree: at no moment was there no `out_dir`
        else:
            os.rename(out_dir, old)
    except OSError as e:
        if e.errno in RENAME_REFUSED and os.path.isdir(out_dir) and not os.path.islink(out_dir):
            _replace_contents(tmp, out_dir)
            return
        raise DestinationError(f"cannot replace {out_dir} ({e.strerror}); remove it yourself or choose another "
                               "directory") from None
    if old != tmp:
        try:
            os.rename(tmp, out_dir)
        except OSError as e:
            os.rename(old, out_dir)  # put the old tree back: the export failed, the destination is as it was
            raise DestinationError(f"cannot move the export into {out_dir} ({e.strerror}); it is unchanged") from None
    fsync_dir(parent)
    if os.path.isdir(old) and not os.path.islink(old):
        shutil.rmtree(old)
    else:
        os.remove(old)


def _replace_contents(tmp: str, out_dir: str) -> None:
    """`--overwrite` of a directory that cannot be renamed: delete its entries, the old `.metadata`
    first and durably, then move the new files in (a copy where they cross file systems), each
    fsynced, `.metadata` last. Not atomic: a reader in between, or after a crash, sees no `.metadata`,
    i.e. no checkpoint, never a mix of old and new or an old one with files missing."""
    try:
        LocalStore(out_dir, direct_io=False).delete_all(first=[METADATA_FILE])
        for name in sorted(os.listdir(tmp), key=lambda n: n == METADATA_FILE):
            dst = os.path.join(out_dir, name)
            shutil.move(os.path.join(tmp, name), dst)
            fd = os.open(dst, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(out_dir)
    except StorageError as e:  # the old .metadata could not be deleted
        raise DestinationError(f"cannot replace the contents of {out_dir}: {e}; export again") from None
    except OSError as e:
        raise DestinationError(f"cannot replace the contents of {out_dir}: {e.strerror or e} "
                               f"({e.filename or out_dir}); it is incomplete, export again") from None
    shutil.rmtree(tmp, ignore_errors=True)

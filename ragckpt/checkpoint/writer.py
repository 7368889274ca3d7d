"""Saving: each rank writes its own objects; one commit step makes the checkpoint visible.

A rank never waits for another and never plans collectively: it writes its buffer chunks, its zarr
array document and its extras, then `ranks/<rank>.json` (its per-block checksums) last. Rank 0 also
writes the global metadata. `commit` checks every rank finished, consolidates the checksums into
binary tables and writes the `COMMITTED` marker with create-if-absent, so a crash at any point leaves
either no marker (unmistakably incomplete) or a complete checkpoint.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import operator
import os
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from ragckpt.args import check_count, check_flag
from ragckpt.checkpoint import manifest as mf
from ragckpt.checkpoint.save_queue import wait_for_background_saves
from ragckpt.cpus import usable_cpus
from ragckpt.errors import (
    DestinationError,
    DestinationExistsError,
    FormatError,
    IntegrityError,
    LayoutError,
    OptionError,
)
from ragckpt.format.dtypes import DTYPE_TO_ST, as_bytes, dtype_name, storage_dtype, torch_dtype
from ragckpt.format.layout import FlatLayout
from ragckpt.format.names import is_text
from ragckpt.format.placement import world_size_of
from ragckpt.format.runs import copy_bits, copy_runs, flat_bits, host_bits
from ragckpt.planner.planner import GranularitySpec
from ragckpt.planner.state import CheckpointLayout
from ragckpt.storage.checksum import DEFAULT_BLOCK_BYTES, block_crcs, crc32c
from ragckpt.storage.config import default_io_concurrency
from ragckpt.storage.destination import attach_note, check_checkpoint_destination, replacing, require_separate
from ragckpt.storage.direct import ThreadBuffers, aligned_empty, zeros
from ragckpt.storage.lock import claim_for_save, claim_holder, claim_url, read_claim, release_claim
from ragckpt.storage.store import Store, open_store
from ragckpt.workpool import StoppablePool

if TYPE_CHECKING:
    import torch
else:
    from ragckpt.lazy import torch

# fill(start_elem, stop_elem) -> bytes of those elements of one rank buffer
ChunkSource = Callable[[int, int], memoryview]


class SaveConflictError(DestinationError, FormatError):
    """Two saves went for one directory: a rank of the one that did not claim it first is refused
    before writing anything, and `commit` refuses another save's directory or records of two saves,
    rather than make a checkpoint of both."""


#: environment variables that every process of one job shares and two jobs running at once do
#: not (torchrun's run id, a Slurm job step, the rendezvous address a job's ranks meet at)
_JOB_TOKEN_VARS = (("RAGCKPT_JOB_TOKEN",), ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT"),
                   ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_RESTART_COUNT"),
                   ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT"))
_process_token = uuid.uuid4().hex


def _new_process_token() -> None:
    global _process_token
    _process_token = uuid.uuid4().hex


# a forked child is another process: two jobs forked from one parent must not share an identity
os.register_at_fork(after_in_child=_new_process_token)


def job_token() -> str:
    """What the processes of one job share without talking to each other: the first of
    `RAGCKPT_JOB_TOKEN`, torchrun's `TORCHELASTIC_RUN_ID` (with its restart count), Slurm's job
    and step id, or the `MASTER_ADDR:MASTER_PORT` a torch.distributed job's ranks rendezvous at
    (two jobs running at once cannot listen on one port), else a token of this process alone."""
    for names in _JOB_TOKEN_VARS:
        first = os.environ.get(names[0], "")
        if first and first != "none":  # torchrun's run id without --rdzv-id/--standalone
            return "|".join(f"{n}={os.environ.get(n, '')}" for n in names)
    return f"process={_process_token}"


def save_identity(save_id: str | None) -> str:
    """The identity every rank of one save records and `commit` requires all ranks to share. A
    given `save_id` is it. Without one, ranks cannot agree on a random id without a collective or
    waiting for rank 0's document (ranks never wait), so it is derived from what they do share, the
    job's token (`job_token`); the layout need not be in it, since the fingerprint every record
    carries covers the layout beside the identity. Two jobs racing into one directory
    therefore always differ, and a retry by a new job is told from an earlier job's leftovers;
    ranks of one job in separate processes with no job token in their environment differ too,
    which `commit` refuses in one line (pass `save_id`, or set `RAGCKPT_JOB_TOKEN`)."""
    if save_id is not None:
        return save_id
    return "auto-" + hashlib.sha256(job_token().encode()).hexdigest()[:16]


def default_workers() -> int:
    """Writer/reader thread-pool width: `RAGCKPT_IO_CONCURRENCY` when set (object stores want many
    requests in flight), else twice the usable CPUs (`ragckpt.cpus`), capped at 16 (local disks gain
    nothing beyond)."""
    if os.environ.get("RAGCKPT_IO_CONCURRENCY"):
        return default_io_concurrency()
    return min(16, usable_cpus() * 2)


#: working memory a streaming conversion holds by default (import-hf, import-dcp, export-hf)
DEFAULT_MEMORY_BYTES = 512 << 20
MIN_MEMORY_BYTES = 4 << 20


def check_memory_budget(memory_bytes: object) -> int:
    """The budget as an int (numpy integers accepted), or a one-line OptionError."""
    try:
        if isinstance(memory_bytes, bool):
            raise TypeError
        n = operator.index(memory_bytes)  # type: ignore[arg-type]
    except TypeError:
        raise OptionError(f"memory budget (--memory / memory_bytes) must be a whole number of bytes, got "
                          f"{memory_bytes!r}") from None
    if n < MIN_MEMORY_BYTES:
        raise OptionError(f"memory budget (--memory / memory_bytes) of {n} bytes is too small; give at least "
                          f"{MIN_MEMORY_BYTES >> 20} MiB")
    return n


def chunk_for_memory(memory_bytes: int, workers: int, cap: int = mf.DEFAULT_MAX_CHUNK_BYTES) -> int:
    """Destination chunk size that keeps `write_streaming` with `workers` threads within
    `memory_bytes`: each thread holds about one chunk (two on object stores, which join the parts
    before a PUT). Whole MiB (whole default checksum blocks), at least 1 MiB, at most `cap`."""
    memory_bytes = check_memory_budget(memory_bytes)
    chunk = max(1 << 20, min(256 << 20, memory_bytes // (2 * max(1, workers))))
    return min(cap, (chunk >> 20) << 20)


def write_root_metadata(store: Store, layout: CheckpointLayout, *, block_bytes: int, max_chunk_bytes: int,
                        user: dict | None, save_id: str | None = None, claim: bool = False) -> None:
    """Global documents: root group (with the manifest), group nodes and per-tensor unit tables.
    `claim` (for a destination just checked to be empty) creates the root document
    create-if-absent, so that of two jobs started into one destination at once, one stops here
    instead of both writing the same objects."""
    manifest, tables = mf.layout_to_manifest(layout, block_bytes=block_bytes, max_chunk_bytes=max_chunk_bytes,
                                             user=user, save_id=save_id)
    # the root document first: from the first object on, the directory says what it is (an
    # uncommitted checkpoint, and for a reshard, of what), so a re-run can recognise its remainder
    root_doc = [mf.group_doc({mf.FORMAT_NAME: manifest})]
    if claim and store.atomic_create:
        try:
            store.write(mf.ROOT_META_KEY, root_doc, create_only=True)
        except DestinationExistsError:
            raise DestinationExistsError(f"another job started writing a checkpoint into {store.url} at the same "
                                         "time; let one of them finish, or use another destination") from None
    else:  # replaced whole: a save cut short here must leave no torn document, which reads as corrupt
        store.write(mf.ROOT_META_KEY, root_doc, atomic=True)
    for li, table in tables.items():
        write_table(store, f"meta/units/{li}", table, compressed=True)
    if tables:  # the group, so that plain zarr lists the tables when it walks the hierarchy
        store.write("meta/units/zarr.json", [mf.group_doc()])
    store.write("buffers/zarr.json", [mf.group_doc()])
    for bi, b in enumerate(layout.buffers):
        smax = int(layout.rank_sizes(bi).max())
        ch = mf.chunking(smax, b.dtype, max_chunk_bytes, block_bytes)
        store.write(f"{mf.buffer_key(bi)}/zarr.json", [mf.buffer_array_doc(b, layout.world_size, smax, ch)])


def table_chunk_key(path: str, ndim: int) -> str:
    return f"{path}/c/" + "/".join("0" for _ in range(ndim))


def write_table(store: Store, path: str, table: np.ndarray, *, compressed: bool = False,
                atomic: bool = False) -> int | None:
    """A small metadata table as a single-chunk zarr array; returns the chunk object's crc32c, or
    None for an empty table (zarr stores no chunk for it). `atomic`: see `Store.write`."""
    table = np.ascontiguousarray(table)
    if table.dtype.byteorder == ">":
        table = table.astype(table.dtype.newbyteorder("<"))
    raw = memoryview(table).cast("B") if table.size else b""  # no copy: a units table can be 300 MiB
    if compressed:
        from numcodecs import Zstd  # about 0.5 s to import: only compressed tables need it

        raw = bytes(Zstd(level=3).encode(table))
    store.write(f"{path}/zarr.json", [mf.table_array_doc(table.shape, table.dtype, compressed=compressed)],
                atomic=atomic)
    if not table.size:
        return None
    store.write(table_chunk_key(path, table.ndim), [raw], atomic=atomic)
    return crc32c(raw)


def decode_table(raw: bytes, shape: tuple[int, ...], dtype: np.dtype, *, compressed: bool) -> np.ndarray:
    """The table held by chunk object bytes `raw` (as `write_table` wrote them)."""
    if compressed:
        from numcodecs import Zstd  # about 0.5 s to import: only compressed tables need it

        raw = Zstd().decode(raw)
        # the decoded bytes are the table's own memory (read-only): a copy would double a 300 MiB table
        return np.frombuffer(raw, dtype=dtype).reshape(shape)
    return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()


def write_rank_buffer(store: Store, layout: CheckpointLayout, buffer: int, rank: int, fill: ChunkSource, *,
                      block_bytes: int, chunking: mf.Chunking, chunks: range | None = None) -> np.ndarray:
    """Write one rank's buffer as whole chunk objects (only `chunks` of them when given); returns
    the per-block crc32c table of what it wrote."""
    spec = layout.buffers[buffer]
    n = int(layout.rank_sizes(buffer)[rank])
    ch = chunking
    crcs = []
    for j in range(ch.count(n)) if chunks is None else chunks:
        lo, hi = j * ch.chunk_elems, min(n, (j + 1) * ch.chunk_elems)
        data = fill(lo, hi)
        if len(data) != (hi - lo) * ch.itemsize:
            raise LayoutError(f"buffer '{spec.name}' rank {rank}: chunk source gave {len(data)} bytes, "
                              f"expected {(hi - lo) * ch.itemsize}")
        crcs.append(block_crcs(data, block_bytes))
        parts = [data]
        pad = ch.chunk_bytes - len(data)
        if pad:
            parts.append(zeros(pad))  # zarr stores every chunk at full size
        store.write(mf.chunk_key(buffer, rank, j), parts)
    return np.concatenate(crcs) if crcs else np.zeros(0, dtype=np.uint32)


def rank_fingerprint(layout: CheckpointLayout, block_bytes: int, max_chunk_bytes: int,
                     save_id: str | None = None) -> str:
    """The fingerprint a rank records for the save it belongs to (see `manifest.layout_fingerprint`).
    Kept on the layout: an engine saves with one layout all run long, and a row layout's units table
    at 8,192 ranks takes 0.1-0.2 s to serialise and hash."""
    cache = layout.__dict__.setdefault("_fingerprints", {})
    key = (block_bytes, max_chunk_bytes, save_id)
    if key not in cache:
        cache[key] = mf.layout_fingerprint(*mf.layout_to_manifest(
            layout, block_bytes=block_bytes, max_chunk_bytes=max_chunk_bytes, user=None, save_id=save_id))
    return cache[key]


def write_rank_manifest(store: Store, rank: int, crcs: Mapping[int, np.ndarray], nbytes: Mapping[int, int],
                        extra: tuple[int, int] | None, fingerprint: str, save_id: str | None = None) -> dict:
    doc = {
        "rank": rank,
        "layout_fingerprint": fingerprint,
        **({} if save_id is None else {"save_id": save_id}),
        "buffers": {str(b): {"nbytes": int(nbytes[b]), "crc32c": [int(c) for c in crcs[b]]} for b in crcs},
        "extra": None if extra is None else {"nbytes": extra[0], "crc32c": extra[1]},
    }
    store.write(mf.rank_manifest_key(rank), [json.dumps(doc).encode()])
    return doc


def _write_extra(store: Store, rank: int, raw: bytes | None) -> tuple[int, int] | None:
    """Store a rank's extras object; (size, crc32c) for its record, None when it has none."""
    if raw is None:
        return None
    store.write(mf.extra_key(rank), [raw])
    return len(raw), crc32c(raw)


def _tensor_fill(t: torch.Tensor) -> ChunkSource:
    raw = as_bytes(t)
    isz = t.element_size()
    return lambda lo, hi: raw[lo * isz : hi * isz]


def extra_bytes(extra: Mapping[str, torch.Tensor] | None, meta: Mapping[str, str] | None) -> bytes | None:
    """A rank's extras as the one safetensors object `write_shard` stores (None when it has none)."""
    if not extra and not meta:
        return None
    from safetensors.torch import save  # loads torch: only a save with extras needs it

    # copies: extras are small (RNG states, positions), and safetensors refuses tensors sharing memory
    tensors = {k: copy_bits(torch.empty(v.shape, dtype=v.dtype, device="cpu"), v.detach()) for k, v in (extra or {}).items()}
    return save(tensors, metadata=dict(meta or {}))


def check_write_options(user: object, block_bytes: object, max_chunk_bytes: object) -> None:
    """The arguments every writer checks before it touches storage, so that a typo never costs an
    existing checkpoint (overwrite deletes first) or leaves half a save behind."""
    if user is not None:
        if not isinstance(user, dict):
            raise TypeError(f"user metadata must be a dict of JSON values, got {type(user).__name__}")
        try:
            json.dumps(user, allow_nan=False)
            why = json_text_problem(user, "user")
        except (TypeError, ValueError) as e:
            why = str(e)
        except RecursionError:
            why = "it is nested too deeply"
        if why:
            raise ValueError(f"user metadata is not plain JSON ({why}); use str, int, finite float, bool, None, "
                             "list and dict values") from None
    for name, v, hi in (("block_bytes", block_bytes, mf.MAX_BLOCK_BYTES),
                        ("max_chunk_bytes", max_chunk_bytes, mf.MAX_CHUNK_BYTES)):
        if not mf.is_count(v, 1, hi):
            raise ValueError(f"{name} must be an integer from 1 to {hi:,}, got {v!r}")


def json_text_problem(value: object, where: str) -> str | None:
    """Why `value`, which `json.dumps` takes, would not read back as what it says: two keys JSON
    stores as one (it writes the key 1 as "1", as a config's id2label has it, so {1: .., "1": ..}
    would keep one of them), or text that is not valid Unicode (a lone surrogate, which UTF-8
    cannot encode). None when it is fine."""
    if isinstance(value, dict):
        seen: dict[str, object] = {}
        for k, v in value.items():
            if isinstance(k, str) and not is_text(k):
                return f"{where} has the key {ascii(k)}, not valid Unicode text"
            stored = k if isinstance(k, str) else next(iter(json.loads(json.dumps({k: 0}))))
            if stored in seen:
                return f"{where} has the keys {seen[stored]!r} and {k!r}, which JSON stores as one key {stored!r}"
            seen[stored] = k
            why = json_text_problem(v, f"{where}[{k!r}]")
            if why:
                return why
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            why = json_text_problem(v, f"{where}[{i}]")
            if why:
                return why
    elif isinstance(value, str) and not is_text(value):
        return f"{where} is {ascii(value)}, not valid Unicode text"
    return None


def check_tensors(items: Mapping[str, object], where: str, *, raw_bytes: bool = True) -> None:
    """Every value is a dense tensor with data (not on the meta device). `raw_bytes`: the caller
    stores the tensors' memory as it is, which a lazily conjugated or negated view does not hold as
    its values (a caller that copies them with `copy_` resolves those)."""
    for name, t in items.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{where}'{name}' is a {type(t).__name__}, not a torch.Tensor")
        if t.device.type == "meta":
            raise ValueError(f"{where}'{name}' is on the meta device and has no data to save; materialize it first")
        if t.layout != torch.strided:
            raise TypeError(f"{where}'{name}' is a {str(t.layout).removeprefix('torch.')} tensor; save its dense "
                            "form (t.to_dense())")
        if raw_bytes and (t.is_conj() or t.is_neg()):
            raise ValueError(f"{where}'{name}' is a lazily conjugated or negated view, whose memory does not hold "
                             "its values; pass t.resolve_conj() (or t.resolve_neg())")


def check_state(state: Mapping[str, torch.Tensor], layout: CheckpointLayout) -> None:
    """`state` holds exactly the tensors of `layout`, each with its shape and dtype."""
    names = set(layout.names())
    for name in state:
        if name not in names:
            raise LayoutError(f"tensor '{name}' is not in the layout; drop it from the state or build the layout "
                              "with it")
    for name in layout.names():
        if name not in state:
            raise LayoutError(f"tensor '{name}' of the layout is missing from the state")
    for spec in layout.buffers:
        for name in spec.tensors:
            t = state[name]
            if tuple(t.shape) != layout.shape(name) or _named_dtype(t, f"tensor '{name}'") != spec.dtype:
                raise LayoutError(f"tensor '{name}' is {tuple(t.shape)} {dtype_name(t.dtype)}, the layout expects "
                                  f"{layout.shape(name)} {spec.dtype}")


def check_padding_is_zero(layout: CheckpointLayout, bi: int, rank: int, t: torch.Tensor) -> None:
    """Layout padding (flat layouts) is stored as the buffer holds it, and FORMAT.md promises zeros:
    a buffer from `aligned_empty` that was never zeroed would otherwise write stray memory contents
    into the checkpoint. Checks only the padding bytes, typically a sliver of the buffer."""
    lay = layout.layout_of(bi)
    if not isinstance(lay, FlatLayout):
        return
    seg = lay.rank_segments(rank)
    gap_lo = np.concatenate([[0], seg.offset + seg.length])
    gap_hi = np.concatenate([seg.offset, [t.numel()]])
    keep = gap_hi > gap_lo
    if not keep.any():
        return
    raw = np.frombuffer(as_bytes(t), dtype=np.uint8)
    isz = t.element_size()
    for lo, hi in zip(gap_lo[keep].tolist(), gap_hi[keep].tolist(), strict=True):
        if raw[lo * isz : hi * isz].any():
            raise LayoutError(f"rank {rank}: buffer '{layout.buffers[bi].name}' holds non-zero values in layout "
                              f"padding (elements [{lo}, {hi})); zero the buffer once when allocating it "
                              "(e.g. aligned_empty(...).zero_())")


def save_shard(
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
) -> dict:
    """Write rank `rank`'s share: its flat buffer for every buffer of `layout` (zero-copy from the
    tensors), plus per-rank `extra` tensors (RNG state, ...) and string `extra_meta`. Rank 0 also
    writes the global metadata and `user` metadata. Call `commit` once every rank has returned.
    `commit` refuses ranks that saved with another layout or as another save. `save_id`, any
    string every rank of one save passes (a step number and a job id, say; an engine passes one),
    is the save's identity; without it one is derived from the job's token (`save_identity`), so
    two jobs racing into one directory, or a retry and an earlier attempt's leftovers, are told
    apart either way. The first rank of a save to reach `url` claims it for that save, and a rank
    of another save is refused (`SaveConflictError`) before writing anything, so of two jobs
    racing into one directory only one writes there (docs/FORMAT.md section 5). `save_shard_async`
    does the same with training blocked only while the buffers are copied."""
    check_shard(rank, buffers, layout, extra=extra, extra_meta=extra_meta, user=user, block_bytes=block_bytes,
                max_chunk_bytes=max_chunk_bytes, save_id=save_id)
    wait_for_background_saves(url)
    rank = int(rank)  # a numpy integer (a rank from an array) would not serialise into the rank's record
    raw = extra_bytes(extra, extra_meta)
    flats = {}
    for spec in layout.buffers:
        t = flat_bits(buffers[spec.name].detach())
        if t.device.type != "cpu" or not t.is_contiguous():
            # a page-aligned staging copy goes to a local disk with no further copy (storage.direct)
            t = copy_bits(aligned_empty(t.numel(), t.dtype), t)
        flats[spec.name] = t
    for bi, spec in enumerate(layout.buffers):
        check_padding_is_zero(layout, bi, rank, flats[spec.name])
    return write_shard(url, rank, flats, layout, raw_extra=raw, user=user, storage_options=storage_options,
                       block_bytes=block_bytes, max_chunk_bytes=max_chunk_bytes, save_id=save_id)


def check_shard(rank: object, buffers: Mapping[str, torch.Tensor], layout: CheckpointLayout, *,
                extra: Mapping[str, torch.Tensor] | None, extra_meta: Mapping[str, str] | None, user: object,
                block_bytes: object, max_chunk_bytes: object, save_id: object) -> None:
    """Every argument of a rank's save, checked before anything is copied or written."""
    check_write_options(user, block_bytes, max_chunk_bytes)
    if save_id is not None and not isinstance(save_id, str):
        raise TypeError(f"save_id must be a str, got {type(save_id).__name__}")
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)):
        raise TypeError(f"rank must be an integer, got {rank!r}")
    if not isinstance(layout, CheckpointLayout):
        raise TypeError(f"rank {rank}: layout must be a CheckpointLayout (CheckpointLayout.build, or an engine's "
                        f"own), got {type(layout).__name__}")
    for what, value, holds in (("buffers", buffers, "names to tensors"), ("extra", extra, "names to tensors"),
                               ("extra_meta", extra_meta, "str to str")):
        if (value is not None or what == "buffers") and not isinstance(value, Mapping):
            raise TypeError(f"rank {rank}: {what} must map {holds}, got a {type(value).__name__}")
    for k, v in (extra_meta or {}).items():
        if not (isinstance(k, str) and isinstance(v, str) and is_text(k) and is_text(v)):
            raise TypeError(f"rank {rank}: extra_meta[{ascii(k)}] = {ascii(v)[:60]}: extra_meta must map str to str "
                            "(valid Unicode text)")
    check_tensors(buffers, f"rank {rank}: buffer ")
    check_tensors(extra or {}, f"rank {rank}: extra ")
    for name, t in (extra or {}).items():  # extras are one safetensors object per rank
        if not isinstance(name, str) or name == "__metadata__" or not is_text(name):
            raise FormatError(f"rank {rank}: extra name {name!r} cannot be stored (the extras object is safetensors, "
                              "whose header reserves '__metadata__' and names tensors with valid Unicode str); rename it")
        if _named_dtype(t, f"rank {rank}: extra '{name}'") not in DTYPE_TO_ST:
            raise FormatError(f"rank {rank}: extra '{name}' is {dtype_name(t.dtype)}, which the extras object "
                              "(safetensors) cannot hold; pass it as a view of another dtype (t.view(torch.float64))")
    unknown = sorted(set(buffers) - {b.name for b in layout.buffers})
    if unknown:
        raise LayoutError(f"rank {rank}: buffer '{unknown[0]}' is not in the layout; buffers: "
                          f"{[b.name for b in layout.buffers]}")
    if not 0 <= rank < layout.world_size:
        raise LayoutError(f"rank {rank} is outside the layout's world size {layout.world_size}")
    for bi, spec in enumerate(layout.buffers):
        if spec.name not in buffers:
            raise LayoutError(f"rank {rank}: buffer '{spec.name}' is missing; got {sorted(buffers)}")
        t = buffers[spec.name]
        want = int(layout.rank_sizes(bi)[rank])
        if _named_dtype(t, f"rank {rank}: buffer '{spec.name}'") != spec.dtype:
            raise LayoutError(f"rank {rank}: buffer '{spec.name}' has dtype {dtype_name(t.dtype)}, layout says {spec.dtype}")
        if t.numel() != want:
            raise LayoutError(f"rank {rank}: buffer '{spec.name}' has {t.numel()} elements, layout says {want}")


def _named_dtype(t: torch.Tensor, what: str) -> str:
    """`dtype_name` of `t`, whose error names the tensor (`what`): "dtype torch.float8_e4m3fnuz is
    not supported" alone does not say which of a save's tensors has it."""
    try:
        return dtype_name(t.dtype)
    except FormatError as e:
        raise FormatError(f"{what}: {e}") from None


def write_shard(url: str, rank: int, flats: Mapping[str, torch.Tensor], layout: CheckpointLayout, *,
                raw_extra: bytes | None, user: dict | None, storage_options: dict | None, block_bytes: int,
                max_chunk_bytes: int, save_id: str | None) -> dict:
    """The writing half of `save_shard`, for arguments `check_shard` passed: `flats` are contiguous
    1-D CPU tensors whose padding `check_padding_is_zero` passed (written as they are: they must not
    change until this returns) and `raw_extra` the serialised extras (`extra_bytes`)."""
    store = open_store(url, storage_options)
    save_id = save_identity(save_id)
    _refuse_committed(store, "save into a new directory")
    _claim(store, save_id, rank)
    # an earlier attempt's record must not outlive the objects this attempt is about to rewrite:
    # `commit` would take the torn rank for a finished one
    store.delete(mf.rank_manifest_key(rank))
    if rank == 0:
        _refuse_foreign_root_doc(store)
        write_root_metadata(store, layout, block_bytes=block_bytes, max_chunk_bytes=max_chunk_bytes, user=user,
                            save_id=save_id)
    crcs, nbytes = {}, {}
    for bi, spec in enumerate(layout.buffers):
        t = flats[spec.name]
        ch = mf.buffer_chunking(layout, bi, max_chunk_bytes, block_bytes)
        crcs[bi] = write_rank_buffer(store, layout, bi, rank, _tensor_fill(t), block_bytes=block_bytes, chunking=ch)
        nbytes[bi] = t.numel() * t.element_size()
    extra_info = _write_extra(store, rank, raw_extra)
    store.sync()  # the data is durable before a record can describe it
    if store.exists(mf.COMMIT_KEY):  # another job committed this directory while this rank wrote into it
        raise DestinationError(f"{store.url} was committed by another save while rank {rank} was writing into it, "
                               f"so that checkpoint now holds rank {rank}'s objects of this save: run `ragckpt "
                               "verify` on it, and give every save its own directory")
    doc = write_rank_manifest(store, rank, crcs, nbytes, extra_info,
                              rank_fingerprint(layout, block_bytes, max_chunk_bytes, save_id), save_id)
    store.sync()  # and the record too: the rank is done when save_shard returns
    return doc


def _claim(store: Store, save_id: str, rank: int) -> None:
    """Take `store` for save `save_id` before rank `rank` writes anything (see `lock.claim_for_save`),
    or refuse in one line when another save has it. The claim is checked again against COMMITTED:
    a commit deletes its claim after writing the marker, so a rank of a losing save that arrives
    just then creates a claim of its own, and must not take that for leave to write."""
    other = claim_for_save(store, save_id)
    if other is not None:
        where = claim_url(store)
        raise SaveConflictError(f"{store.url} is being saved into by another save {other.get('save_id')!r} "
                                f"({claim_holder(other)}; its claim is {where}), so rank {rank} of save {save_id!r} "
                                "wrote nothing there: give every save its own directory, or, if that save is dead, "
                                f"delete {where} (and what it left in the directory) and re-run")
    if store.exists(mf.COMMIT_KEY):
        release_claim(store, save_id)
        _refuse_committed(store, "save into a new directory")


def _refuse_gone_records(store: Store, W: int, given: set[int], present: set[str]) -> None:
    """A record gone since the ranks returned means another save into this directory has begun (it
    deletes a rank's record first) and is rewriting that rank's objects: do not commit them."""
    gone = [r for r in range(W) if mf.rank_manifest_key(r) not in present]
    if gone:
        r = gone[0]
        if r in given:  # or it never was here: that rank saved to another URL
            raise FormatError(f"cannot commit {store.url}: the record of rank {r} ({mf.rank_manifest_key(r)}) is "
                              "not in storage though the rank returned it: it saved to another URL (give every "
                              "rank this one), or another save has started into this directory and is rewriting "
                              "its objects (give every save its own directory); then re-save")
        raise FormatError(f"cannot commit {store.url}: the record of rank {r} ({mf.rank_manifest_key(r)}) "
                          "is gone from storage, so another save has started into this directory and is rewriting "
                          "its objects; give every save its own directory, then re-save")


def _commit_identity(save_id: str | None, docs: Mapping[int, dict]) -> str | None:
    """The save a committer says it commits: its `save_id`, else the one its ranks' records name."""
    if save_id is not None:
        if not isinstance(save_id, str):
            raise TypeError(f"save_id must be a str, got {type(save_id).__name__}")
        return save_id
    named = {d.get("save_id") for d in docs.values() if isinstance(d, dict)} - {None}
    return named.pop() if len(named) == 1 else None


def commit(url: str, *, storage_options: dict | None = None,
           rank_manifests: Mapping[int, dict] | Sequence[dict] | None = None, save_id: str | None = None) -> None:
    """Check that every rank finished, consolidate checksums, then write the commit marker last.
    `rank_manifests` ({rank: what its `save_shard` returned}, or the list `all_gather_object` gives
    of them) spares reading every rank's document back from storage. `save_id` (or the identity
    the given records name) is the save this committer means to commit: another save's ranks in the
    directory are then refused, rather than committed by a job whose own ranks were refused."""
    wait_for_background_saves(url)
    store = open_store(url, storage_options)
    # re-writing the tables of a committed checkpoint would tear them under its readers
    _refuse_committed(store, "nothing to do")
    if not store.exists(mf.ROOT_META_KEY):
        raise FormatError(f"{store.url} has no checkpoint metadata (zarr.json); rank 0 has not saved yet")
    root_raw = store.read(mf.ROOT_META_KEY)
    m = mf.manifest_from_root_doc(root_raw, store.url)
    W, block = int(m["world_size"]), int(m["block_bytes"])
    try:
        tables = {int(k): read_table(store, f"meta/units/{k}") for k in _units_layouts(m)}
    except Exception:  # noqa: BLE001 - missing, cut short, undecodable: rank 0 did not finish
        raise FormatError(f"cannot commit {store.url}: its metadata is incomplete (rank 0 has not finished "
                          "saving); re-run rank 0's save_shard first") from None
    layout = mf.layout_from_manifest(m, tables, store.url)
    docs = _given_records(rank_manifests, W)
    given = set(docs)
    mine = _commit_identity(save_id, docs)
    if mine is not None and mine != m.get("save_id"):
        raise SaveConflictError(f"cannot commit {store.url} as save {mine!r}: rank 0's metadata (zarr.json) there is "
                                f"of save {m.get('save_id')!r}, another save that has the directory; give every "
                                "save its own directory")
    claim = read_claim(store)
    if claim is not None and claim.get("save_id") != m.get("save_id"):
        # the directory is another save's, whose ranks are writing there (rank 0's metadata may
        # still be an earlier save's): refused before this commit writes anything
        _refuse_gone_records(store, W, given, set(store.list("ranks")))
        raise SaveConflictError(f"cannot commit {store.url}: another save {claim.get('save_id')!r} "
                                f"({claim_holder(claim)}) holds it ({claim_url(store)}) and is rewriting the objects "
                                f"of save {m.get('save_id')!r}; give every save its own directory, then re-save")
    missing_keys = [r for r in range(W) if r not in docs]
    if missing_keys:
        # one listing says which ranks finished, then their documents come in one concurrent batch:
        # a check and a read per rank cost two requests each, one after another, at 8,192 ranks
        listed = set(store.list("ranks"))
        keys = {mf.rank_manifest_key(r): r for r in missing_keys}
        present = [k for k in keys if k in listed]
        for key, raw in zip(present, store.read_many(present), strict=True):
            try:
                doc = mf.parse_json(raw)
            except ValueError:  # cut short by a crash before the rank returned: not finished
                continue
            if isinstance(doc, dict):
                docs[keys[key]] = doc
    absent = [r for r in range(W) if r not in docs]
    if absent:
        shown = ", ".join(str(r) for r in absent[:8]) + (" ..." if len(absent) > 8 else "")
        raise FormatError(f"cannot commit {store.url}: {len(absent)} of {W} ranks have not finished saving "
                          f"(ranks {shown}); re-run their save_shard first")
    for r in range(W):
        _check_record(r, docs[r], store.child(mf.rank_manifest_key(r)) if r not in given else f"rank_manifests[{r}]")
    want = mf.layout_fingerprint(m, tables)
    for r in range(W):
        got = docs[r].get("layout_fingerprint")
        if got is not None and got != want:
            used, hint = (("layout and save_id", "") if "save_id" in m
                          else ("layout", " (pass save_id to tell save attempts apart)"))
            sid, ident = docs[r].get("save_id"), m.get("save_id")
            # either side may be the stale one: a retry whose rank 0 has not re-saved yet leaves the
            # previous attempt's zarr.json, against which every re-saved rank looks wrong
            text = (f"rank {r} saved for another layout or save attempt ({mf.rank_manifest_key(r)}) than rank 0's "
                    f"metadata (zarr.json); re-save rank {r} with the {used} rank 0 used, or, if rank 0 has not "
                    f"re-saved yet, commit after it has{hint}")
            if isinstance(sid, str) and sid != ident:
                raise SaveConflictError(f"cannot commit {store.url}, which two saves wrote into (rank 0's metadata is "
                                        f"of save {ident!r}, rank {r} of save {sid!r}; give every save its own "
                                        f"directory): {text}")
            raise FormatError(f"cannot commit {store.url}: {text}")
    objects = {mf.ROOT_META_KEY: crc32c(root_raw)}
    for li in tables:
        if tables[li].size:
            key = table_chunk_key(f"meta/units/{li}", 2)
            objects[key] = crc32c(store.read(key))
    for bi, spec in enumerate(layout.buffers):
        sizes = layout.rank_sizes(bi) * storage_dtype(spec.dtype).itemsize
        parts = []
        for r in range(W):
            entry = docs[r]["buffers"].get(str(bi))
            if entry is None or int(entry["nbytes"]) != int(sizes[r]):
                raise IntegrityError(f"rank {r} saved buffer '{spec.name}' with the wrong size or not at all; "
                                     "it was saved with a different layout — re-save that rank")
            c = np.asarray(entry["crc32c"], dtype=np.uint32)
            if len(c) != -(-int(sizes[r]) // block):
                raise IntegrityError(f"rank {r}: buffer '{spec.name}' checksum table has {len(c)} blocks, "
                                     f"expected {-(-int(sizes[r]) // block)}")
            parts.append(c)
        table = np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint32)
        crc = write_table(store, f"meta/crc/{bi}", table, atomic=True)
        if crc is not None:  # an empty buffer has no table object
            objects[table_chunk_key(f"meta/crc/{bi}", 1)] = crc
    extra = np.full((W, 2), -1, dtype=np.int64)
    for r in range(W):
        e = docs[r].get("extra")
        if e:
            extra[r] = (int(e["nbytes"]), int(e["crc32c"]))
    crc = write_table(store, "meta/extra", extra, atomic=True)
    if crc is not None:
        objects[table_chunk_key("meta/extra", 2)] = crc
    # leftovers of an earlier attempt into this directory with a larger layout or other extras
    listed = [*store.list("buffers"), *store.list("extra"), *store.list("ranks"), *store.list("meta")]
    _refuse_gone_records(store, W, given, set(listed))
    store.delete_many(mf.stray_objects(listed, layout, int(m["max_chunk_bytes"]), block, extra[:, 0],
                                       units_layouts=tables))
    store.write("meta/zarr.json", [mf.group_doc()], atomic=True)
    if layout.buffers:
        store.write("meta/crc/zarr.json", [mf.group_doc()], atomic=True)
    store.sync()
    marker = {
        "format": mf.FORMAT_NAME,
        "format_version": mf.FORMAT_VERSION,
        "world_size": W,
        "committed_at": mf.creation_info()["time"],
        "total_bytes": layout.total_bytes(),
        "objects_crc32c": objects,
    }
    store.write(mf.COMMIT_KEY, [json.dumps(marker, indent=1).encode()], create_only=True)
    if claim is not None:  # committed: the marker keeps every save out now (see `_claim`)
        release_claim(store, m.get("save_id"))


def _given_records(rank_manifests: Mapping[int, dict] | Sequence[dict] | None, world_size: int) -> dict[int, dict]:
    """`commit`'s `rank_manifests` as {rank: record}, checked for shape: a key that is no rank of
    this world, or a value that is no record is refused in one line before anything is written,
    rather than failing inside the commit with a bare KeyError. A list (what `all_gather_object`
    returns) must hold every rank's record in rank order; each record names its rank, so records
    out of order are still caught."""
    if rank_manifests is None:
        return {}
    if isinstance(rank_manifests, list | tuple):
        if len(rank_manifests) != world_size:
            raise LayoutError(f"rank_manifests is a list of {len(rank_manifests)} records for a {world_size}-rank "
                              "checkpoint; give every rank's record in rank order, or a dict keyed by rank")
        rank_manifests = dict(enumerate(rank_manifests))
    if not isinstance(rank_manifests, Mapping):
        raise TypeError(f"rank_manifests must map each rank to what its save_shard returned (or list every "
                        f"rank's in rank order), got a {type(rank_manifests).__name__}")
    out: dict[int, dict] = {}
    for r, doc in rank_manifests.items():
        if isinstance(r, bool) or not isinstance(r, (int, np.integer)) or not 0 <= int(r) < world_size:
            raise LayoutError(f"rank_manifests has key {r!r}, not a rank of this {world_size}-rank checkpoint; key "
                              "each record by the rank whose save_shard returned it")
        out[int(r)] = doc
    return out


def _check_record(rank: int, doc: object, where: str) -> None:
    """A rank's record must be a save_shard result of that very rank: records swapped by a
    mis-ordered gather would commit every rank's checksums against another rank's data, and the
    checkpoint would then look corrupt on disk when it is not."""
    if not isinstance(doc, dict) or not isinstance(doc.get("buffers"), dict):
        raise FormatError(f"{where} is not a save_shard record (got {type(doc).__name__}); pass what rank "
                          f"{rank}'s save_shard returned, or re-run its save_shard")
    if doc.get("rank") != rank:
        raise FormatError(f"{where} is the record of rank {doc.get('rank')!r}, not of rank {rank} (records out of "
                          "order?); key each record by the rank whose save_shard returned it")
    for b, entry in doc["buffers"].items():
        if not isinstance(entry, dict) or not isinstance(entry.get("nbytes"), int) \
                or not isinstance(entry.get("crc32c"), list):
            raise FormatError(f"{where}: buffer {b} is no {{nbytes, crc32c}} entry; re-run rank {rank}'s save_shard")
    e = doc.get("extra")
    if e is not None and (not isinstance(e, dict) or not isinstance(e.get("nbytes"), int)
                          or not isinstance(e.get("crc32c"), int)):
        raise FormatError(f"{where}: its extra entry is no {{nbytes, crc32c}}; re-run rank {rank}'s save_shard")


def _refuse_committed(store: Store, then: str) -> None:
    """A save or commit never touches a directory holding a commit marker, damaged ones included
    (a dangling symlink is no free space), and says which of the two it found."""
    if not store.exists(mf.COMMIT_KEY):
        return
    problem = store.object_problem(mf.COMMIT_KEY)
    if problem is not None:
        raise DestinationExistsError(f"{store.child(mf.COMMIT_KEY)} is {problem}, not a regular file: the "
                                     "checkpoint there is damaged; remove it, or save into a new directory")
    raise DestinationExistsError(f"{store.url} is already committed; {then}")


def _refuse_foreign_root_doc(store: Store) -> None:
    """Rank 0 replaces the root zarr.json of an earlier attempt at this save, never another
    dataset's: a plain zarr group or array (or any other file by that name) there would lose its
    metadata. Checked by rank 0 alone, before it writes anything; the other ranks' objects go under
    names only a checkpoint uses."""
    if not store.exists(mf.ROOT_META_KEY):
        return
    kind = mf.root_doc_kind(store.read(mf.ROOT_META_KEY))
    if kind != "manifest":
        what = {"zarr": "a plain zarr group or array", "array": "one of a checkpoint's own arrays"}.get(kind, "a file")
        raise DestinationExistsError(f"{store.child(mf.ROOT_META_KEY)} belongs to {what}, not to a ragckpt checkpoint; "
                                     "save_shard would replace it: save into an empty or new directory")


def _units_layouts(m: dict) -> list[int]:
    return [i for i, e in enumerate(m["layouts"]) if "units" in e]


def read_table(store: Store, path: str) -> np.ndarray:
    """Read a table written by `write_table` (used before the reader exists, e.g. at commit)."""
    doc = json.loads(store.read(f"{path}/zarr.json"))
    shape = tuple(doc["shape"])
    dt = np.dtype(doc["data_type"])
    if not int(np.prod(shape)):
        return np.zeros(shape, dtype=dt)
    raw = store.read(table_chunk_key(path, len(shape)))
    return decode_table(raw, shape, dt, compressed=any(c["name"] == "zstd" for c in doc["codecs"]))


# -- writing a whole state from one process ---------------------------------------------------------

def _global_buffers(state: Mapping[str, torch.Tensor], layout: CheckpointLayout, buffer: int) -> tuple[torch.Tensor, np.ndarray]:
    """All ranks' buffers of one buffer concatenated (rank-major) and the rank start offsets."""
    spec = layout.buffers[buffer]
    lay = layout.layout_of(buffer)
    sizes = lay.rank_sizes()
    starts = np.cumsum(sizes) - sizes
    dt = state[spec.tensors[0]].dtype if spec.tensors else torch.uint8
    out = torch.zeros(int(sizes.sum()), dtype=dt, device="cpu")
    if isinstance(lay, FlatLayout):
        # rank-major concatenation is the global flat buffer itself: place every tensor at its offset
        for name, off in zip(spec.tensors, lay.offsets, strict=True):
            flat = flat_bits(state[name].detach())
            copy_bits(out[off : off + flat.numel()], flat)
        return out, starts
    seg = lay.segments()
    for slot, name in enumerate(spec.tensors):
        s = seg.for_slot(slot)
        copy_runs(out, starts[s.rank] + s.offset, flat_bits(state[name].detach()), s.flat_start, s.length)
    return out, starts


def write_global(
    state: Mapping[str, torch.Tensor],
    url: str,
    world_size: int,
    layout: str | CheckpointLayout = "ragged",
    granularity: GranularitySpec = "row",
    *,
    align: int = 1,
    user: dict | None = None,
    overwrite: bool = False,
    storage_options: dict | None = None,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    max_chunk_bytes: int = mf.DEFAULT_MAX_CHUNK_BYTES,
    workers: int | None = None,
) -> CheckpointLayout:
    """Write `state` as a committed checkpoint exactly as `world_size` ranks would have written it,
    from one process. `layout` is a kind ('ragged' plans with `granularity`, 'row' = FSDP2 Shard(0),
    'element' = FSDP1/ZeRO flat partition) or a ready `CheckpointLayout`."""
    check_flag("overwrite", overwrite)
    check_count("workers", workers, optional=True)
    world_size = world_size_of(world_size)  # before any per-rank table is allocated
    check_write_options(user, block_bytes, max_chunk_bytes)
    check_tensors(state, "tensor ")
    wait_for_background_saves(url)
    state = {k: host_bits(v.detach()) for k, v in state.items()}
    if isinstance(layout, CheckpointLayout):
        lay = layout
        if lay.world_size != world_size:
            raise LayoutError(f"layout is for {lay.world_size} ranks but world_size={world_size}")
    else:
        lay = CheckpointLayout.build({k: (tuple(v.shape), _named_dtype(v, f"tensor '{k}'")) for k, v in state.items()},
                                     world_size, layout, granularity, align)
    check_state(state, lay)
    globs = {}
    for bi in range(len(lay.buffers)):
        g, starts = _global_buffers(state, lay, bi)
        globs[bi] = (as_bytes(g), starts, g.element_size())

    def fill_for(bi: int, rank: int) -> ChunkSource:
        raw, starts, isz = globs[bi]
        base = int(starts[rank]) * isz
        return lambda lo, hi: raw[base + lo * isz : base + hi * isz]

    write_streaming(url, lay, fill_for, user=user, overwrite=overwrite, storage_options=storage_options,
                    block_bytes=block_bytes, max_chunk_bytes=max_chunk_bytes, workers=workers)
    return lay


def write_streaming(
    url: str,
    layout: CheckpointLayout,
    fill_for: Callable[[int, int], ChunkSource],
    *,
    user: dict | None = None,
    overwrite: bool = False,
    storage_options: dict | None = None,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    max_chunk_bytes: int = mf.DEFAULT_MAX_CHUNK_BYTES,
    workers: int | None = None,
    ranks: Sequence[int] | None = None,
    progress: Callable[[int], None] | None = None,
    sources: Sequence[str] = (),
    do_commit: bool = True,
    write_metadata: bool | None = None,
    share_chunks: bool = False,
    extra_for: Callable[[int], bytes | None] | None = None,
    root_identity: tuple[int, int] | None = None,
) -> dict[int, dict]:
    """Write a checkpoint for `layout` whose rank buffers come from `fill_for(buffer, rank)` chunk by
    chunk (at most one chunk per worker in memory), then commit. `ranks` restricts this process to a
    share of the ranks (several processes, one commit at the end); rank 0's owner writes the global
    metadata. `write_metadata=False` skips the destination check and the global metadata when a
    coordinator (the resharder's parent process) already wrote them; None keeps the rank-0 rule.
    Returns the rank manifests written (for a later `commit(rank_manifests=...)`). `sources` are the
    inputs (an HF directory, a DCP checkpoint) the destination must not overlap. `share_chunks`:
    when there are fewer ranks than threads, threads take runs of neighbouring chunks of a rank
    (every run calls `fill_for` anew) instead of whole ranks; worth it where each chunk waits on the network,
    not where filling a chunk is CPU work that threads would contend for. `extra_for(rank)` gives a
    rank's extras object (safetensors bytes, as `save_shard` stores them) or None.
    `root_identity` (what the coordinator's `Store.pin_root` returned) stops this share's writes
    once the destination directory is no longer that one. The foundation of write_global, import
    and reshard."""
    require_separate(url, sources)
    check_write_options(user, block_bytes, max_chunk_bytes)
    store = open_store(url, storage_options)
    if root_identity is not None:
        store.pin_root(root_identity)
    ranks = list(range(layout.world_size)) if ranks is None else list(ranks)
    if write_metadata is None:
        write_metadata = 0 in ranks or len(ranks) == layout.world_size
    # a whole job run here replaces an existing DST only once it has committed its own: the old one is
    # set aside meanwhile and put back if the job fails (storage.destination.replacing)
    whole_job = write_metadata and do_commit and len(ranks) == layout.world_size
    guard = (replacing(url, sources, overwrite=True, storage_options=storage_options, tag=uuid.uuid4().hex[:12],
                       new_bytes=layout.total_bytes())
             if overwrite and whole_job else contextlib.nullcontext())
    # a failure once this job wrote DST's metadata leaves it uncommitted, and a plain re-run is then
    # refused (with --overwrite, `replacing` says where the old contents are instead)
    started = False
    try:
        with guard:
            if write_metadata:
                check_checkpoint_destination(store, overwrite)
                write_root_metadata(store, layout, block_bytes=block_bytes, max_chunk_bytes=max_chunk_bytes, user=user,
                                    claim=True)
                if root_identity is None:  # this job's directory from now on (see Store.pin_root)
                    root_identity = store.pin_root()
                started = whole_job and not overwrite
            docs: dict[int, dict] = {}
            chunkings = [mf.buffer_chunking(layout, bi, max_chunk_bytes, block_bytes) for bi in range(len(layout.buffers))]
            fingerprint = rank_fingerprint(layout, block_bytes, max_chunk_bytes)

            sizes = [layout.rank_sizes(bi) for bi in range(len(layout.buffers))]  # elements

            def write_part(r: int, bi: int, chunks: range | None = None) -> np.ndarray:
                inner = fill_for(bi, r)

                def src(lo: int, hi: int) -> memoryview:
                    pool.stop_point()  # the save failed or was interrupted: stop at a chunk boundary
                    data = inner(lo, hi)
                    if progress is not None:
                        progress(len(data))
                    return data

                return write_rank_buffer(store, layout, bi, r, src, block_bytes=block_bytes, chunking=chunkings[bi],
                                         chunks=chunks)

            def manifest(r: int, crcs: dict[int, np.ndarray]) -> tuple[int, dict]:
                nbytes = {bi: int(sizes[bi][r]) * chunkings[bi].itemsize for bi in range(len(layout.buffers))}
                info = _write_extra(store, r, extra_for(r) if extra_for is not None else None)
                return r, write_rank_manifest(store, r, crcs, nbytes, info, fingerprint)

            def one_rank(r: int) -> tuple[int, dict]:
                return manifest(r, {bi: write_part(r, bi) for bi in range(len(layout.buffers))})

            def some_chunks(task: tuple[int, int, range]) -> np.ndarray:
                r, bi, js = task
                return write_part(r, bi, js)

            threads = workers or default_workers()
            with StoppablePool(threads) as pool:  # one rank failing or Ctrl-C stops the others at a chunk boundary
                if len(ranks) >= threads or not share_chunks:
                    for r, doc in pool.map(one_rank, ranks):
                        docs[r] = doc
                else:
                    # fewer ranks than threads (a reshard to a small world from an object store): threads
                    # share each rank's chunks, which are separate objects, so several requests overlap.
                    # A task is a run of neighbouring chunks, about two per thread and rank buffer: a
                    # chunk then usually follows its neighbour in the same thread, which has the source
                    # blocks they share (the resharder's BlockMemo; a task per chunk read 1.5-1.7x a
                    # ragged source's bytes with 1 MiB chunks), and threads still balance.
                    tasks = [(r, bi, js) for r in ranks for bi in range(len(layout.buffers))
                             for js in _runs(chunkings[bi].count(sizes[bi][r]), 2 * threads)]
                    parts: dict[tuple[int, int], list[np.ndarray]] = {}
                    for (r, bi, _), crc in zip(tasks, pool.map(some_chunks, tasks), strict=True):
                        parts.setdefault((r, bi), []).append(crc)
                    empty = np.zeros(0, dtype=np.uint32)
                    for r, doc in pool.map(lambda r: manifest(r, {bi: np.concatenate(parts.get((r, bi), [empty]))
                                                                  for bi in range(len(layout.buffers))}), ranks):
                        docs[r] = doc
            store.sync()
            if do_commit:
                store.pin_root(root_identity)  # still this job's directory: commit opens it by path
                commit(url, storage_options=storage_options, rank_manifests=docs)
                started = False
            return docs
    except BaseException as e:
        if started:
            attach_note(e, "the destination was left uncommitted; re-run with --overwrite to replace it")
        raise


def _runs(count: int, parts: int) -> list[range]:
    """`range(count)` cut into at most `parts` runs of neighbours whose lengths differ by at most one
    (10 chunks in 8 parts are 2, 2, 1, ... so four threads finish in 3 chunk times; runs of 2 by a
    ceil step would make 5 of them, and 4 chunk times)."""
    n = max(1, min(count, parts))
    base, extra = divmod(count, n)
    starts = [i * base + min(i, extra) for i in range(n + 1)]
    return [range(a, b) for a, b in zip(starts, starts[1:], strict=False) if b > a]


def segment_fill(layout: CheckpointLayout, buffer: int, rank: int,
                 read_flat: Callable[[str, int, int, torch.Tensor], None], scratch: ThreadBuffers) -> ChunkSource:
    """A chunk source that assembles rank `rank`'s buffer from per-tensor flat reads:
    `read_flat(name, start, stop, out)` must fill `out` with flat elements [start, stop) of `name`.
    Padding stays zero. Used by importers whose source is organised by tensor. Chunks are built in
    the calling thread's buffer of `scratch` (one for all ranks: page-aligned, so local disks write
    it with no bounce copy), so the returned bytes are valid until that thread's next chunk (the
    writer consumes each chunk before asking for the next)."""
    spec = layout.buffers[buffer]
    lay = layout.layout_of(buffer)
    seg = lay.rank_segments(rank)
    ends = seg.offset + seg.length
    dt = torch_dtype(spec.dtype)

    def fill(lo: int, hi: int) -> memoryview:
        buf = scratch.take_tensor(hi - lo, dt)
        buf.zero_()  # padding between tensors stays zero
        i0 = int(np.searchsorted(ends, lo, side="right"))
        i1 = int(np.searchsorted(seg.offset, hi, side="left"))
        for i in range(i0, i1):
            off, fs = int(seg.offset[i]), int(seg.flat_start[i])
            a, b = max(off, lo), min(int(ends[i]), hi)
            if b > a:
                read_flat(spec.tensors[int(seg.slot[i])], fs + a - off, fs + b - off, buf[a - lo : b - lo])
        return as_bytes(buf)

    return fill

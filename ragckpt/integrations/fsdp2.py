"""FSDP2 state dicts straight to and from ragckpt, from every rank of a process group.

`save_state_dict(url, {"model": msd, "optim": osd})` is what each rank of an FSDP2
(`torch.distributed.fsdp.fully_shard`) job calls instead of `torch.distributed.checkpoint.save`; the
state dicts are those of `get_state_dict(model, optim, options=StateDictOptions(
flatten_optimizer_state_dict=True))`. `load_state_dict(url, state_dict)` fills a state dict of the
same structure in place, at any world size, before `set_state_dict`.

Why a "row" layout: FSDP2 shards every parameter and Adam moment `Shard(0)` over a 1-D mesh, splitting
rows exactly as `torch.chunk` does, which is ragckpt's row layout. Each rank's flat buffer is then just
its local shards one after the other, so a save is a copy of what the rank holds and nothing is
gathered. Plain (replicated) tensors, buffers and Adam's 0-d `step`, are split the same way, every
rank writing its own row chunk of its full copy.

Names and non-tensor values follow `ragckpt.convert.dcp` exactly, so the result is the checkpoint
`import-dcp` would make of the same state saved with DCP: the state dict is flattened with dots as DCP
flattens it (`optim.state.<fqn>.exp_avg`), the `model.` prefix is stripped, and non-tensor values
(hyperparameters) are carried in user metadata (`dcp.bytes`, with the readable `optim.param_groups`
view). `export-dcp` and `export-hf` therefore work on it as they are.

Every phase ends with one collective that reports each rank's outcome to all ranks: a failure on any
rank makes every rank raise the same one-line error naming it, instead of leaving the others waiting
in a later collective.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import datetime
import hashlib
import io
import json
import struct
import uuid
import warnings
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor, Replicate, Shard

from ragckpt import errors
from ragckpt.args import check_flag
from ragckpt.checkpoint import manifest as mf
from ragckpt.checkpoint.background import StagingBuffers
from ragckpt.checkpoint.manifest import DEFAULT_MAX_CHUNK_BYTES
from ragckpt.checkpoint.partial import PartialBlocks
from ragckpt.checkpoint.reader import Checkpoint
from ragckpt.checkpoint.reader import open as open_checkpoint
from ragckpt.checkpoint.save_queue import submit_save, wait_for_background_saves
from ragckpt.checkpoint.writer import (
    check_tensors,
    check_write_options,
    commit,
    default_workers,
    save_identity,
    save_shard,
)
from ragckpt.convert.dcp import (
    MAX_CARRIED_BYTES,
    MODEL_PREFIX,
    PARAM_GROUPS_PREFIX,
    USER_KEY,
    dcp_key_to_name,
    dcp_user_metadata,
    decode_bytes,
    default_planner_path,
    groups_by_param,
    jsonable,
)
from ragckpt.errors import (
    DestinationExistsError,
    FormatError,
    LayoutError,
    OptionError,
    RagckptError,
    UnknownNameError,
)
from ragckpt.format.dtypes import as_bytes, dtype_name, torch_dtype
from ragckpt.format.placement import chunk_sizes, row_numel
from ragckpt.format.runs import copy_bits, flat_bits, host_bits
from ragckpt.phases import Phase, exchange, failure_message, one_line
from ragckpt.planner.state import CheckpointLayout
from ragckpt.storage.checksum import DEFAULT_BLOCK_BYTES, crc32c
from ragckpt.storage.destination import check_checkpoint_destination, replacing
from ragckpt.storage.direct import aligned_empty
from ragckpt.storage.lock import release_claim
from ragckpt.storage.store import open_store
from ragckpt.workpool import StoppablePool

__all__ = ["async_save_state_dict", "load_state_dict", "save_state_dict"]

_USE_DCP = ("save it with torch.distributed.checkpoint (dcp.save) and convert the result with "
            "`ragckpt import-dcp`")


# -- the state dict, flattened as DCP flattens it -----------------------------------------------------

@dataclass(frozen=True)
class _Leaf:
    """One value of the state dict: its DCP key (the dotted path) and where it sits, so that a load
    can put a value back into the caller's own containers."""

    key: str
    path: tuple[str | int, ...]
    container: Any  # the dict or list holding it
    index: Any  # its key or position in `container`
    value: Any


def _holds_state(items: list) -> bool:
    """DCP walks into a list only when a tensor or a mapping lies somewhere inside it; any other list
    (betas as a list, say) is one value."""
    return any(isinstance(x, torch.Tensor | Mapping) or (isinstance(x, list) and _holds_state(x)) for x in items)


def _flatten(state_dict: Mapping) -> list[_Leaf]:
    """Every leaf of `state_dict` under the key DCP's `flatten_state_dict` gives it, so that names (and
    therefore `export-dcp`) agree with a DCP save of the same dict."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"the state dict must be a mapping, got {type(state_dict).__name__}")
    leaves: list[_Leaf] = []

    def visit(path: tuple[str | int, ...], container: Any, index: Any, value: Any) -> None:
        if isinstance(value, Mapping):
            for k, v in value.items():
                visit((*path, str(k)), value, k, v)
        elif isinstance(value, list) and _holds_state(value):
            for i, v in enumerate(value):
                visit((*path, i), value, i, v)
        else:
            leaves.append(_Leaf(".".join(map(str, path)), path, container, index, value))

    for k, v in state_dict.items():
        visit((str(k),), state_dict, k, v)
    seen: set[str] = set()
    for leaf in leaves:
        if leaf.key in seen:
            raise LayoutError(f"two entries of the state dict flatten to the same key '{leaf.key}'; rename one")
        seen.add(leaf.key)
    return leaves


def _model_prefix(state_dict: Mapping) -> str:
    """`model.` for the `{"model": ..., "optim": ...}` convention of DCP saves (known from the structure
    here, no guessing as import-dcp must), else "" (a bare model state dict)."""
    return MODEL_PREFIX if isinstance(state_dict.get("model"), Mapping) else ""


def _unwrap_stateful(state_dict: Any) -> tuple[Any, list[tuple[str, Stateful, Any]]]:
    """The state dict with each top-level Stateful (an object with state_dict/load_state_dict: an
    app state wrapping model and optimizer, an LR scheduler) replaced by its `state_dict()`, as
    dcp.save and dcp.load do, and those (key, object, the dict it gave), for a load to hand back."""
    if not isinstance(state_dict, Mapping):
        return state_dict, []
    out, objects = {}, []
    for k, v in state_dict.items():
        if isinstance(v, Stateful) and not isinstance(v, torch.Tensor):
            out[k] = v.state_dict()
            objects.append((str(k), v, out[k]))
        else:
            out[k] = v
    return out, objects


def _stateless_optimizers(ck: Checkpoint, objects: list[tuple[str, Stateful, Any]]) -> list[str]:
    """Keys of optimizers passed as objects that hold no state yet (never stepped) while the
    checkpoint has state under their key: a load fills nothing of that state (the optimizer's
    `state_dict()` has no tensors to fill), silently, as with dcp.load."""
    names = ck.names()
    return [k for k, obj, _ in objects if isinstance(obj, torch.optim.Optimizer) and not obj.state
            and any(n.startswith(f"{k}.state.") for n in names)]


# -- tensors: what this rank holds of each ----------------------------------------------------------

@dataclass(frozen=True)
class _Tensor:
    """A tensor entry as this rank holds it: `local` is the value's flat elements
    `[flat_start, flat_start + local.numel())` of the global tensor (its Shard(0) rows, or all of it)."""

    name: str  # ragckpt name
    leaf: _Leaf
    local: torch.Tensor
    shape: tuple[int, ...]  # global
    dtype: str
    sharded: bool
    flat_start: int


def _describe(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)} {dtype_name(t.dtype)}"


def _check_dtensor(key: str, t: DTensor, group_ranks: list[int]) -> bool:
    """True when `t` is FSDP2's Shard(0) over this group, False when replicated; anything else (HSDP's
    2-D mesh, tensor parallel Shard(1), Partial) is refused: its pieces are not row chunks."""
    mesh = t.device_mesh
    if mesh.ndim != 1 or len(t.placements) != 1:
        raise LayoutError(f"entry '{key}' is a DTensor on a {mesh.ndim}-D device mesh {tuple(t.placements)}; "
                          f"save_state_dict handles 1-D meshes (FSDP2) only: {_USE_DCP}")
    p = t.placements[0]
    if isinstance(p, Replicate):
        return False
    if type(p) is not Shard or p.dim != 0:
        raise LayoutError(f"entry '{key}' is a DTensor placed {p!r}; save_state_dict handles Shard(0) (FSDP2) and "
                          f"Replicate only: {_USE_DCP}")
    mesh_ranks = [int(r) for r in mesh.mesh.flatten().tolist()]
    if mesh_ranks != group_ranks:
        raise LayoutError(f"entry '{key}' is sharded over global ranks {mesh_ranks}, but the process group is "
                          f"{group_ranks}; pass the mesh's process group as group=")
    return True


def _tensor(name: str, leaf: _Leaf, rank: int, world: int, group_ranks: list[int]) -> _Tensor:
    """What this rank holds of tensor entry `leaf`, checked against the row layout's split."""
    t: torch.Tensor = leaf.value
    try:
        dt = dtype_name(t.dtype)
    except FormatError as e:
        raise FormatError(f"entry '{leaf.key}': {e}") from None
    shape = tuple(int(s) for s in t.shape)
    if isinstance(t, DTensor):
        sharded = _check_dtensor(leaf.key, t, group_ranks)
        local = t.to_local()
    else:
        sharded, local = False, t
    if not sharded:
        if tuple(local.shape) != shape:
            raise LayoutError(f"entry '{leaf.key}' holds {tuple(local.shape)} locally for a replicated {shape}")
        return _Tensor(name, leaf, local, shape, dt, False, 0)
    rows = chunk_sizes(shape[0], world)
    want = (int(rows[rank]), *shape[1:])
    if tuple(local.shape) != want:
        raise LayoutError(f"entry '{leaf.key}': rank {rank} holds rows {tuple(local.shape)} of {shape}, but "
                          f"torch.chunk over {world} ranks gives it {want}; save_state_dict needs FSDP2's "
                          f"default split (no shard_placement_fn): {_USE_DCP}")
    return _Tensor(name, leaf, local, shape, dt, True, int(rows[:rank].sum()) * row_numel(shape, 1))


@dataclass
class _State:
    """A rank's state dict split into tensor entries (by ragckpt name) and non-tensor leaves."""

    prefix: str
    tensors: dict[str, _Tensor]
    values: list[_Leaf] = field(default_factory=list)

    def layout(self, world: int) -> CheckpointLayout:
        """The row layout of every tensor for `world` ranks: built from global shapes and dtypes
        alone, so every rank builds the same one."""
        return CheckpointLayout.build({n: (e.shape, e.dtype) for n, e in self.tensors.items()}, world, "row")

    def spec(self) -> dict[str, Any]:
        """What every rank must agree on before anything is written: the naming convention, each
        entry's key, and what it holds (a tensor's global shape and dtype)."""
        entries = {e.leaf.key: f"a {e.shape} {e.dtype} tensor" for e in self.tensors.values()}
        entries.update({v.key: "a non-tensor value" for v in self.values})
        return {"prefix": self.prefix, "entries": entries}

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.spec(), sort_keys=True).encode()).hexdigest()

    def replica_checksums(self) -> dict[str, int]:
        """crc32c of every entry each rank holds whole (plain tensors, Replicate DTensors): they are
        stored once, so their copies must agree (a buffer kept per rank, such as BatchNorm statistics
        without SyncBN or an RNG state, does not)."""
        out = {}
        for name, e in self.tensors.items():
            if not e.sharded:
                out[name] = crc32c(as_bytes(flat_bits(e.local.detach(), "cpu")))
        return out


def _split(state_dict: Mapping, rank: int, world: int, group_ranks: list[int]) -> _State:
    """Flatten and check `state_dict` without touching storage: the same pass serves save and load, so
    both name and validate entries identically."""
    leaves = _flatten(state_dict)
    prefix = _model_prefix(state_dict)
    state = _State(prefix, {})
    for leaf in leaves:
        if isinstance(leaf.value, torch.Tensor):
            name = dcp_key_to_name(leaf.key, prefix)
            state.tensors[name] = _tensor(name, leaf, rank, world, group_ranks)
        else:
            state.values.append(leaf)
    check_tensors({e.leaf.key: e.local for e in state.tensors.values()}, "entry ", raw_bytes=False)  # copy_ resolves
    return state


# -- non-tensor values: carried as import-dcp carries them ------------------------------------------

def _encode(leaf: _Leaf) -> bytes:
    """`torch.save` bytes of a non-tensor value, as DCP stores it (the legacy format: a float takes
    about 150 bytes instead of 1.2 KB, and every parameter carries a dozen hyperparameters), checked
    to load back with the weights-only loader that load_state_dict and DCP use."""
    buf = io.BytesIO()
    try:
        torch.save(leaf.value, buf, _use_new_zipfile_serialization=False)
        decode_bytes(buf.getvalue())
    except Exception:  # noqa: BLE001 - any failure means the value cannot be restored
        kind = type(leaf.value)
        raise LayoutError(f"non-tensor entry '{leaf.key}' (a {kind.__module__}.{kind.__qualname__}) cannot be stored: "
                          "the weights-only loader that load_state_dict and dcp.load use would not read it back; "
                          "store it as plain Python values (int, float, str, list, dict) or tensors") from None
    return buf.getvalue()


def _plain_key(value: Any) -> Any:
    """A key equal for two values exactly when `torch.save` writes them identically, for plain
    scalars, strings and tuples or lists of them (a float by its bits: 0.0 is not -0.0); None for
    anything else, which is encoded on its own."""
    if value is None or type(value) in (bool, int, str):  # exact types: a subclass pickles otherwise
        return (type(value).__name__, value)
    if type(value) is float:
        return ("float", struct.pack("<d", value))
    if type(value) in (tuple, list):
        items = tuple(_plain_key(v) for v in value)
        return None if any(i is None for i in items) else (type(value).__name__, items)
    return None


def _user_metadata(state: _State, world: int, user: dict | None) -> dict:
    """The caller's `user` plus the DCP record (`dcp.model_prefix`, `dcp.bytes`, `dcp.planner_data`)
    and the readable `optim.param_groups` view, exactly as import-dcp writes them."""
    carried: dict[str, str] = {}
    decoded: dict[str, Any] = {}
    encoded: dict[Any, bytes] = {}  # an optimizer repeats the same dozen values for every parameter
    total = 0
    for leaf in state.values:
        same = _plain_key(leaf.value)
        raw = encoded.get(same) if same is not None else None
        if raw is None:
            raw = _encode(leaf)
            if same is not None:
                encoded[same] = raw
        total += len(raw)
        if total > MAX_CARRIED_BYTES:
            raise LayoutError(f"non-tensor entries exceed {MAX_CARRIED_BYTES >> 20} MiB (at '{leaf.key}'); they "
                              "ride in the checkpoint's JSON metadata: save large state as tensors instead")
        carried[leaf.key] = base64.b64encode(raw).decode("ascii")
        try:
            decoded[leaf.key] = jsonable(leaf.value)
        except TypeError:  # carried byte for byte all the same
            pass
    leaves = [e.leaf for e in state.tensors.values()] + state.values
    planner = {leaf.key: list(leaf.path) for leaf in leaves if leaf.path != default_planner_path(leaf.key)}
    ours = dcp_user_metadata(model_prefix=state.prefix, world_size=world, carried=carried, decoded=decoded,
                             planner_data=planner)
    clash = sorted(set(ours) & set(user or {}))
    if clash:
        raise ValueError(f"user metadata key '{clash[0]}' is written by save_state_dict itself (from the state "
                         "dict); leave it out of user=")
    meta = {**(user or {}), **ours}
    check_write_options(meta, DEFAULT_BLOCK_BYTES, DEFAULT_MAX_CHUNK_BYTES)
    return meta


def _stored_values(ck: Checkpoint, leaves: list[_Leaf]) -> dict[str, Any]:
    """The stored value of every non-tensor leaf: DCP's bytes when present, else (a checkpoint saved by
    a training engine) the `optim.param_groups` view, with lists made tuples where the state dict
    holds tuples (`betas`)."""
    info = ck.user.get(USER_KEY) if isinstance(ck.user.get(USER_KEY), dict) else {}
    carried = info.get("bytes") or {}
    groups = groups_by_param(ck) if any(leaf.key not in carried for leaf in leaves) else {}
    out: dict[str, Any] = {}
    for leaf in leaves:
        if leaf.key in carried:
            try:
                out[leaf.key] = decode_bytes(base64.b64decode(carried[leaf.key], validate=True))
            except Exception as e:  # noqa: BLE001
                raise FormatError(f"{ck.url}: stored value of '{leaf.key}' does not decode ({one_line(e)})") from None
            continue
        fqn, _, hp = leaf.key.removeprefix(PARAM_GROUPS_PREFIX).rpartition(".")
        hps = groups.get(fqn) if leaf.key.startswith(PARAM_GROUPS_PREFIX) else None
        if not isinstance(hps, dict) or hp not in hps:
            raise UnknownNameError(f"non-tensor entry '{leaf.key}' of the state dict is not in checkpoint {ck.url}")
        v = hps[hp]
        out[leaf.key] = tuple(v) if isinstance(leaf.value, tuple) and isinstance(v, list) else v
    return out


# -- every rank's outcome, to every rank --------------------------------------------------------------

# What a failed write or commit leaves: said on every rank, in the words `attach_note` replaces with
# where the old checkpoint went when the save overwrote one.
_UNCOMMITTED = "the destination was left uncommitted; save again once the cause is fixed"


def _raise(op: str, failed: list[tuple[int, dict]], cause: Exception | None, *, written: bool = False) -> None:
    """The same error on every rank: the lowest failing rank's message, in the class it raised when that
    is one of ragckpt's (so `except LayoutError` works on every rank), else RagckptError. `written`:
    the failure came once ranks had begun writing, so the line says the checkpoint is not usable
    (unless the failure was finding it committed already, which left it as it was)."""
    kind = failed[0][1].get("kind") or ""
    cls = getattr(errors, kind, None)
    if not (isinstance(cls, type) and issubclass(cls, RagckptError)):
        cls = RagckptError
    note = f"; {_UNCOMMITTED}" if written and not issubclass(cls, DestinationExistsError) else ""
    raise cls(f"{op}: {failure_message(failed, 'rank')}{note}") from cause


def _agree(op: str, group: dist.ProcessGroup | None, mine: Phase, *, written: bool = False,
           **extra: object) -> list[dict]:
    """All-gather every rank's outcome of a phase; raise on every rank if any failed."""
    outcomes, failed = exchange(dist, mine, group=group, **extra)
    if failed:
        _raise(op, failed, mine.error, written=written)
    return outcomes


def _group(group: dist.ProcessGroup | None) -> tuple[int, int, list[int]]:
    """(rank, world size, global ranks in group order). Raised locally: with no process group there
    is nobody to wait for."""
    if not dist.is_available() or not dist.is_initialized():
        raise RagckptError("torch.distributed is not initialised; call init_process_group on every rank first")
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    return dist.get_rank(group), dist.get_world_size(group), [int(r) for r in ranks]


# -- save ------------------------------------------------------------------------------------------

def _rank_buffers(layout: CheckpointLayout, rank: int, state: _State,
                  staging: StagingBuffers | None = None) -> dict[str, torch.Tensor]:
    """This rank's flat buffer of every dtype: its piece of each tensor in layout order, copied to
    page-aligned CPU memory (written with no further copy; from CUDA, the one device-to-host copy),
    kept in `staging` when given."""
    out = {}
    if staging is not None:
        staging.wait()
    for bi, spec in enumerate(layout.buffers):
        n_elems, dtype = int(layout.rank_sizes(bi)[rank]), torch_dtype(spec.dtype)
        out[spec.name] = staging.take(spec.name, n_elems, dtype) if staging is not None else aligned_empty(n_elems, dtype)
    _copy_pieces(layout, rank, state, out)
    return out


def _copy_pieces(layout: CheckpointLayout, rank: int, state: _State, bufs: dict[str, torch.Tensor],
                 only: set[str] | None = None) -> None:
    """Copy this rank's piece of every tensor (or of the tensors named in `only`) into its place in
    the rank's flat buffers."""
    for bi, spec in enumerate(layout.buffers):
        buf = bufs[spec.name]
        seg = layout.layout_of(bi).rank_segments(rank)
        for slot, start, n, off in zip(seg.slot.tolist(), seg.flat_start.tolist(), seg.length.tolist(),
                                       seg.offset.tolist(), strict=True):
            if only is not None and spec.tensors[slot] not in only:
                continue
            e = state.tensors[spec.tensors[slot]]
            lo = start - e.flat_start
            if lo < 0 or lo + n > e.local.numel():
                raise LayoutError(f"rank {rank}: entry '{e.leaf.key}' lacks elements [{start}, {start + n}) "
                                  "of its row chunk")
            copy_bits(buf[off : off + n], flat_bits(e.local.detach())[lo : lo + n])


@dataclass
class _Save:
    """One rank's save: its state dict as checked on this rank, and what the ranks compare."""

    url: str
    op: str
    rank: int
    ranks: list[int]
    state: _State
    layout: CheckpointLayout
    meta: dict | None
    digest: str  # of the structure
    replicas: dict[str, int]  # checksums of the entries every rank holds whole
    warning: str = ""  # for rank 0 to give once every collective is behind (warnings may be errors)


def _check_locally(url: str, op: str, state_dict: Mapping[str, Any], rank: int, world: int, ranks: list[int],
                   user: dict | None) -> _Save:
    """Everything this rank can check of its state dict alone, with what the ranks then compare."""
    state = _split(_unwrap_stateful(state_dict)[0], rank, world, ranks)
    if not state.tensors:  # a load may ask for values alone (an LR scheduler), a save may not
        raise LayoutError("the state dict holds no tensors; pass the model's (and optimizer's) state dict, sharded "
                          "on every rank (get_state_dict with full_state_dict=True and cpu_offload=True leaves "
                          "every rank but 0 empty: use its default options)")
    meta = _user_metadata(state, world, user) if rank == 0 else None
    replicas = state.replica_checksums() if world > 1 else {}
    return _Save(url, op, rank, ranks, state, state.layout(world), meta, state.digest(), replicas)


def _begin_save(url: str, state_dict: Mapping[str, Any], group: dist.ProcessGroup | None,
                user: dict | None, args: dict[str, object]) -> _Save:
    """Check this rank's state dict and agree with every other rank that all hold the same structure."""
    rank, world, ranks = _group(group)
    op = f"save_state_dict to {url}"
    here = Phase()
    save = None
    with here.at("check its state dict"):
        save = _check_locally(url, op, state_dict, rank, world, ranks, user)
    _agree_on_structure(op, here, save, world, group, args=args)
    assert save is not None  # every rank's check passed, or _agree_on_structure raised
    return save


def _agree_on_structure(op: str, here: Phase, save: _Save | None, world: int, group: dist.ProcessGroup | None,
                        rank0_values: dict[str, torch.Tensor] | None = None,
                        staged: dict[str, torch.Tensor] | None = None, *, args: dict[str, object]) -> list[str]:
    """The ranks compare their checks (`here`), structures and replicated entries; raises on every
    rank when a check failed or the structures differ. Replicated entries whose copies differ take
    rank 0's values (`rank0_values`, its copies at the call for a background save, else its live
    tensors), also in `staged` buffers already copied; returns their names."""
    # one short digest of the replicas' checksums per rank (the full tables only if they differ:
    # every rank receives every rank's share of this exchange)
    replicas = save.replicas if save is not None else {}
    replicas_digest = hashlib.sha256(json.dumps(replicas, sort_keys=True).encode()).hexdigest() if replicas else ""
    outcomes = _agree(op, group, here, digest=save.digest if save is not None else None, replicas=replicas_digest,
                      args=args)
    assert save is not None  # _agree raised on every rank if any rank's check failed
    # `overwrite` decides which collectives follow: ranks that differ would pair them up wrongly and
    # hang until the group's timeout
    for r, o in enumerate(outcomes):
        for name, value in o["args"].items():
            if value != outcomes[0]["args"][name]:
                raise OptionError(f"{op}: rank {r} passed {name}={value!r}, rank 0 {name}={outcomes[0]['args'][name]!r}; "
                                  "every rank must pass the same (nothing was written)")
    _require_same_structure(op, outcomes, save.state, world, group, "nothing was written")
    if all(o["replicas"] == outcomes[0]["replicas"] for o in outcomes):
        return []
    tables: list = [None] * world
    dist.all_gather_object(tables, replicas, group=group)
    first = tables[0]
    split = [n for n in first if any(t.get(n) != first[n] for t in tables)]
    mine = rank0_values if rank0_values is not None else {n: host_bits(save.state.tensors[n].local.detach()) for n in split}
    copies: list = [{n: mine[n] for n in split} if save.rank == 0 else None]
    dist.broadcast_object_list(copies, src=save.ranks[0], group=group)
    here = Phase()
    with here.at("take rank 0's copies of replicated entries"):
        _take_rank0_replicas(op, save, tables, split, copies[0], staged)
    _agree(op, group, here)
    return split


def _require_same_structure(op: str, outcomes: list[dict], state: _State, world: int,
                            group: dist.ProcessGroup | None, consequence: str) -> None:
    """Raise on every rank when the ranks' structure digests (`outcomes`) differ, naming the first
    entry of the lowest differing rank: ranks that save or load different entries would store a
    tensor no rank fully described, or go on training from a mix of restored and fresh state."""
    differs = [r for r, o in enumerate(outcomes) if o["digest"] != outcomes[0]["digest"]]
    if differs:
        specs: list = [None] * world
        dist.all_gather_object(specs, state.spec(), group=group)  # only now: every rank's keys, to name one
        raise LayoutError(f"{op}: rank {differs[0]}'s state dict {_difference(specs[differs[0]], specs[0])}; every "
                          f"rank must pass the same structure ({consequence})")


def _difference(their_spec: dict[str, Any], first_spec: dict[str, Any]) -> str:
    """How one rank's entries differ from rank 0's, for the error: the first entry that does."""
    if their_spec["prefix"] != first_spec["prefix"]:
        return "is a bare model state dict where rank 0's has a 'model' section, or the other way round"
    theirs, first = their_spec["entries"], first_spec["entries"]
    for key in sorted(set(theirs) | set(first)):
        if key not in first:
            return f"has entry '{key}', which rank 0's lacks (per-rank keys cannot be stored as one tensor)"
        if key not in theirs:
            return f"lacks entry '{key}', which rank 0's has"
        if theirs[key] != first[key]:
            return f"has entry '{key}' as {theirs[key]} where rank 0's has {first[key]}"
    return "differs from rank 0's"


def _take_rank0_replicas(op: str, save: _Save, tables: list[dict[str, int]], split: list[str],
                         copies: dict[str, torch.Tensor], staged: dict[str, torch.Tensor] | None) -> None:
    """Entries each rank holds whole are stored once, as rank 0 holds them, and every rank gets that
    copy back at load (dcp.save keeps whichever rank's copy its planner assigns the entry to). Where copies differ (`tables`: every rank's checksums), every
    rank writes rank 0's (`copies`, on the host: they go to host buffers only), or the stored tensor
    would be a patchwork of every rank's rows; rank 0 warns once the save is over."""
    for n in split:
        save.state.tensors[n] = replace(save.state.tensors[n], local=copies[n])
    if staged is not None:
        _copy_pieces(save.layout, save.rank, save.state, staged, only=set(split))
    first = tables[0]
    r = next(r for r, t in enumerate(tables) if t.get(split[0]) != first[split[0]])
    more = f" (and {len(split) - 1} more)" if len(split) > 1 else ""
    save.warning = (f"{op}: entry '{save.state.tensors[split[0]].leaf.key}'{more} is held whole by every rank but "
                    f"rank {r}'s copy differs from rank 0's; saved rank 0's copy, as dcp.save keeps one, and every "
                    "rank gets it back at load. Keep per-rank state (RNG, loader position) out of the state dict")


def _warn_rank0(save: _Save) -> None:
    """Rank 0's warning of the save, given after its last collective: with warnings turned into
    errors, raising earlier would leave the other ranks waiting."""
    if save.rank == 0 and save.warning:
        warnings.warn(save.warning, RuntimeWarning, stacklevel=3)


def _finish_save(save: _Save, buffers: Callable[[], dict[str, torch.Tensor]], group: dist.ProcessGroup | None,
                 save_id: str | None, storage_options: dict | None, overwrite: bool = False) -> None:
    """Write this rank's shard from `buffers()` (the staging copy, or a background save's copy made
    earlier: a failure there is this rank's failure to write, reported to all), then rank 0 commits
    once every rank has written. With `overwrite`, rank 0 first sets the old checkpoint aside
    (`storage.destination.replacing`) and holds it until the end: deleted once the new one is
    committed, put back if any rank fails."""
    if not overwrite:
        _write_and_commit(save, buffers, group, save_id, storage_options)
        return
    failure: Exception | None = None
    try:
        with contextlib.ExitStack() as old:
            here = Phase()
            if save.rank == 0:
                with here.at("set the old checkpoint aside"):
                    old.enter_context(replacing(save.url, (), overwrite=True, storage_options=storage_options,
                                                tag=uuid.uuid4().hex[:12], new_bytes=save.layout.total_bytes()))
                    # where it could not be set aside (another object store, a mount point, no room
                    # beside it) it is deleted in place, as the one-process writers do
                    check_checkpoint_destination(open_store(save.url, storage_options), True)
            _agree(save.op, group, here)
            _write_and_commit(save, buffers, group, save_id, storage_options)
    except Exception as e:  # noqa: BLE001 - raised below, once rank 0 has put the old checkpoint back
        failure = e
        if save.rank == 0:  # the old checkpoint is back (or kept aside): this save's claim would refuse the next
            try:
                release_claim(open_store(save.url, storage_options), save_identity(save_id))
            except Exception:  # noqa: BLE001 - a claim left behind is named by the next save's refusal
                pass
    # every rank failed or succeeded at the same collective, but rank 0 puts the old checkpoint back
    # (or deletes it) only now: the others wait for that here, and raise its words, which say how it went
    final = [str(failure) if failure is not None else None]
    dist.broadcast_object_list(final, src=save.ranks[0], group=group)
    if final[0] is None and failure is None:
        return
    if failure is None:
        raise RagckptError(final[0])
    if final[0] is not None:
        failure.args = (final[0],)
    raise failure


def _holds_objects(url: str, storage_options: dict | None) -> bool:
    """Whether anything of a checkpoint is at `url` (False where that cannot even be checked)."""
    try:
        store = open_store(url, storage_options)
        return store.exists(mf.ROOT_META_KEY) or mf.holds_rank_objects(store)
    except Exception:  # noqa: BLE001 - a path that is a file, an unreachable store: nothing to describe
        return False


def _write_and_commit(save: _Save, buffers: Callable[[], dict[str, torch.Tensor]], group: dist.ProcessGroup | None,
                      save_id: str | None, storage_options: dict | None) -> None:
    here = Phase()
    doc = None
    with here.at("write its shard"):
        try:
            doc = save_shard(save.url, save.rank, buffers(), save.layout, user=save.meta,
                             storage_options=storage_options, save_id=save_id)
        except DestinationExistsError as e:  # save_shard has no overwrite to offer; this caller has
            raise DestinationExistsError(f"{e} (or pass overwrite=True to replace it)") from None
    _, failed = exchange(dist, here, group=group)
    if failed:
        # the destination was left uncommitted only where objects are there: a path that is a regular
        # file, or writes refused at the first object, left nothing (rank 0 looks, once, for all)
        left = [_holds_objects(save.url, storage_options) if save.rank == 0 else None]
        dist.broadcast_object_list(left, src=save.ranks[0], group=group)
        _raise(save.op, failed, here.error, written=bool(left[0]))
    # every rank's document to rank 0 alone, so the commit reads none back (8,192 requests on S3)
    docs: list | None = [None] * len(save.ranks) if save.rank == 0 else None
    dist.gather_object(doc, docs, dst=save.ranks[0], group=group)
    here = Phase()
    if save.rank == 0:
        with here.at("commit"):
            commit(save.url, storage_options=storage_options, rank_manifests=dict(enumerate(docs or [])))
    result = [here.outcome()]
    dist.broadcast_object_list(result, src=save.ranks[0], group=group)
    if not result[0]["ok"]:
        _raise(save.op, [(0, result[0])], here.error, written=True)


def save_state_dict(
    url: str,
    state_dict: Mapping[str, Any],
    *,
    group: dist.ProcessGroup | None = None,
    save_id: str | None = None,
    user: dict | None = None,
    storage_options: dict | None = None,
    overwrite: bool = False,
) -> None:
    """Save this rank's FSDP2 state dict into the ragckpt checkpoint at `url`; EVERY rank of `group`
    (default: the world) calls it with its own state dict of the same structure, and it returns once
    the checkpoint is committed.

    `state_dict` is `{"model": msd, "optim": osd}` from `get_state_dict(...,
    flatten_optimizer_state_dict=True)` (or a bare model state dict): DTensors sharded Shard(0) or
    replicated on a 1-D mesh, plain tensors (replicated: buffers, Adam's `step`), and non-tensor
    values (hyperparameters, taken from rank 0); top-level Stateful objects are saved as their
    `state_dict()`, as dcp.save does. Entries every rank holds whole are stored once, as rank 0 holds
    them (a warning names any whose copies differ). Local shards may be on any device. Nested meshes
    (HSDP) and other placements are refused before anything is written: save those with DCP and
    `ragckpt import-dcp`. `save_id` and `user` are as for `ragckpt.save_shard`. A committed
    checkpoint at `url` is refused unless `overwrite` (a "latest" directory saved again and again):
    the old one is then set aside and put back if the save fails, deleted once the new one is
    committed.

    Raises the same one-line RagckptError on every rank when any rank fails, naming that rank."""
    check_flag("overwrite", overwrite)
    wait_for_background_saves(url)  # an async save into the same checkpoint first, as one writer would
    save = _begin_save(url, state_dict, group, user, {"overwrite": overwrite, "save_id": save_id})
    _finish_save(save, lambda: _rank_buffers(save.layout, save.rank, save.state), group, save_id, storage_options,
                 overwrite)
    _warn_rank0(save)


_background_groups: dict[tuple[int, ...], tuple[Any, dist.ProcessGroup]] = {}


def _group_timeout(group: dist.ProcessGroup | None) -> datetime.timedelta | None:
    """The timeout the job gave `group` (init_process_group's, for the world), for the group the
    background saves use: new groups otherwise get the backend's default (30 minutes for gloo),
    whatever the job asked for. None when torch does not say."""
    pg = group if group is not None else dist.group.WORLD
    try:
        device = next(iter(pg._device_types))  # noqa: SLF001 - no public accessor for a group's timeout
        timeout = pg._get_backend(device).options._timeout  # noqa: SLF001
    except Exception:  # noqa: BLE001 - another backend or torch version: its default applies
        return None
    return timeout if isinstance(timeout, datetime.timedelta) else None


def _groups_created() -> int | None:
    """How many process groups this process has created: what torch names a group created with local
    synchronisation by (members that disagree compute different names and wait for each other for
    ever). None when torch does not say."""
    try:
        return len(dist.distributed_c10d._world.pg_names)  # noqa: SLF001
    except Exception:  # noqa: BLE001 - another torch version: no check
        return None


def _background_group(ranks: list[int], group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """A gloo group over `ranks`, in the caller's group order, for the collectives of background
    saves, created once per world: the training thread keeps issuing collectives on its own groups
    meanwhile, and two threads must never share one group's collective sequence. Creating a group
    is itself collective, which is why it happens in `async_save_state_dict`, in the caller's thread.
    Over the whole world every rank creates it the ordinary way; over a subgroup only its members
    call this, so it is created with local synchronisation, which names it by how many groups each
    member created before: when those numbers differ, every member raises, asking for a
    `background_group` made by the whole world."""
    key = tuple(ranks)
    world = dist.group.WORLD
    kept = _background_groups.get(key)
    if kept is None or kept[0] is not world:  # none yet, or from a world since destroyed
        timeout = _group_timeout(group)
        if len(ranks) == dist.get_world_size() and ranks == sorted(ranks):
            made = dist.new_group(backend="gloo", timeout=timeout)
        else:
            counts: list = [None] * len(ranks)
            dist.all_gather_object(counts, _groups_created(), group=group)
            if len(set(counts)) > 1:  # torch would name the group differently on some members: a hang
                raise RagckptError(
                    f"async_save_state_dict to a subgroup: its ranks have created different numbers of process "
                    f"groups ({min(counts)} to {max(counts)}), so they cannot create the background group among "
                    "themselves; pass background_group=dist.new_group(ranks, backend='gloo', sort_ranks=False), "
                    "created by every rank of the world")
            made = dist.new_group(ranks, backend="gloo", timeout=timeout, use_local_synchronization=True,
                                  sort_ranks=False)
        _background_groups[key] = (world, made)
    return _background_groups[key][1]


def async_save_state_dict(
    url: str,
    state_dict: Mapping[str, Any],
    *,
    group: dist.ProcessGroup | None = None,
    save_id: str | None = None,
    user: dict | None = None,
    storage_options: dict | None = None,
    staging: StagingBuffers | None = None,
    overwrite: bool = False,
    background_group: dist.ProcessGroup | None = None,
) -> Future[None]:
    """`save_state_dict` in the background, in place of `dcp.async_save`: EVERY rank of `group` calls
    it; it returns once this rank has checked its state dict and copied its shards to host memory,
    waiting for no other rank, so training may go on (and update the state) at once. The ranks compare
    their state dicts, write and commit in the background. The future is done when the checkpoint is
    committed, or raises on every rank the one-line error `save_state_dict` would have, bad entries
    found by a rank's own checks included.

    Saves run one after another in a per-process writer thread, with their collectives on a gloo
    group over the same ranks, in the same order and with the same timeout (created at the first
    call, or `background_group`, one the caller made: over a subgroup `group`, members that created
    different numbers of process groups before must pass one). Wait for the future before destroying
    the process group or leaving the process. `staging` (a `ragckpt.StagingBuffers`, one per rank) keeps
    the host copies for the next save; without it each save allocates its own. `overwrite` is as for
    `save_state_dict`; the old checkpoint is set aside in the background too."""
    check_flag("overwrite", overwrite)
    rank, world, ranks = _group(group)
    op = f"save_state_dict to {url}"
    background = background_group if background_group is not None else _background_group(ranks, group)
    here = Phase()
    save, rank0_values, staged, failure = None, None, None, None
    with here.at("check its state dict"):
        save = _check_locally(url, op, state_dict, rank, world, ranks, user)
        save.meta = copy.deepcopy(save.meta)  # written later: the values of the call, not what `user` holds then
        if rank == 0 and save.replicas:  # what other ranks take if their copies differ: rank 0's of now
            rank0_values = {n: host_bits(save.state.tensors[n].local.detach(), copy=True) for n in save.replicas}
    with staging.claimed() if staging is not None else contextlib.nullcontext():
        if save is not None:
            try:
                staged = _rank_buffers(save.layout, rank, save.state, staging)
            except Exception as e:  # noqa: BLE001 - the writer thread reports it in the write phase, on every rank
                failure = e
        # the comparison with the other ranks, the write and the commit all run in the writer thread: the
        # caller waits for nothing but its own checks and copy. A rank whose checks failed takes part too,
        # and its future raises the same error as every other rank's (it is no error at the call, which
        # would leave the caller nothing to wait on before tearing its process group down)
        future = submit_save(_finish_in_background, here, save, rank0_values, staged, failure, world, background,
                             save_id, storage_options, overwrite, op, url=url)
        if staging is not None:
            staging.hold(future, set(staged or {}))
    return future


def _finish_in_background(here: Phase, save: _Save | None, rank0_values: dict[str, torch.Tensor] | None,
                          staged: dict[str, torch.Tensor] | None, failure: Exception | None, world: int,
                          background: dist.ProcessGroup, save_id: str | None, storage_options: dict | None,
                          overwrite: bool, op: str) -> None:
    """A background save's collective part: agree on the structure, take rank 0's values of replicated
    entries whose copies differ (into the staged copy), write, commit."""
    _agree_on_structure(op, here, save, world, background, rank0_values, staged,
                        args={"overwrite": overwrite, "save_id": save_id})
    assert save is not None  # _agree_on_structure raised if any rank's check failed

    def buffers() -> dict[str, torch.Tensor]:
        if failure is not None:
            raise failure
        return staged or {}

    _finish_save(save, buffers, background, save_id, storage_options, overwrite)
    _warn_rank0(save)


# -- load ------------------------------------------------------------------------------------------

def _check_against(ck: Checkpoint, state: _State) -> None:
    """Every tensor of the state dict is in the checkpoint with its shape and dtype, so a load either
    fills the whole state or reads nothing. The checkpoint may hold more (an optimizer's state when
    only the model is loaded, for evaluation or fine-tuning), as for dcp.load."""
    # named by the state dict's key, which the user wrote, and by the tensor name it is stored under
    # (`model.extra.weight` is stored as `extra.model.extra.weight`: see convert.dcp.dcp_key_to_name)
    missing = [e for n, e in state.tensors.items() if n not in ck]
    if missing:
        more = f" (and {len(missing) - 1} more entries)" if len(missing) > 1 else ""
        raise UnknownNameError(f"entry '{missing[0].leaf.key}' of the state dict (tensor '{missing[0].name}') is "
                               f"not in checkpoint {ck.url}{more}")
    for name, e in state.tensors.items():
        m = ck.meta(name)
        if tuple(m.shape) != e.shape or m.dtype != e.dtype:
            raise LayoutError(f"entry '{e.leaf.key}' of the state dict is {e.shape} {e.dtype} but tensor '{name}' "
                              f"is {tuple(m.shape)} {m.dtype} in checkpoint {ck.url}; load never reshapes or casts")


def _fill(ck: Checkpoint, state: _State) -> None:
    """Read what this rank holds of every tensor straight into the state dict's own tensors: a
    Shard(0) local shard is one flat range of its tensor (its rows), a replicated tensor the whole
    of it. `Checkpoint.read_flat` reads only the byte ranges that range comes from, whatever layout
    and world size the checkpoint has, verifying each block as it lands in place: no staging
    buffer (whose first touch and extra copy cost as much as the reads), no layout to build.
    Shards on a GPU go through a host window at a time (`read_flat` does that for any device
    tensor), so host memory does not grow with the shard times the threads; a non-contiguous
    tensor (rare) through one CPU tensor of its size."""

    # a block holding the end of one tensor's shard and the start of the next is read by both, in
    # part, and verified from the two pieces (`PartialBlocks`): read whole by each, a 4 -> 2 rank
    # FSDP2 load of 63 16 MiB tensors read 1.28x its bytes
    partial = PartialBlocks(ck)

    def one(e: _Tensor) -> None:
        local = e.local.detach()
        start, stop = e.flat_start, e.flat_start + local.numel()
        if local.is_contiguous():  # in place on the host, through host windows on a GPU
            ck.read_flat(e.name, start, stop, out=local, partial=partial)
        else:
            copy_bits(local, ck.read_flat(e.name, start, stop).view(local.shape))

    def in_turn(group: list[_Tensor]) -> None:
        for e in group:
            one(e)

    groups = _sharing_memory(list(state.tensors.values()))
    with StoppablePool(default_workers()) as pool:
        list(pool.map(in_turn, sorted(groups, key=lambda g: -sum(e.local.numel() for e in g))))
    partial.complete()  # the blocks no shard read whole: checked before the state is used


def _sharing_memory(entries: list[_Tensor]) -> list[list[_Tensor]]:
    """`entries` grouped by overlapping memory, each group in state-dict order. Tied weights (an
    embedding and the LM head) are one tensor under two keys: filled at once by two threads, each
    verifying its blocks in place while the other overwrote them, they failed as "corrupt" or ended
    up a patchwork of both. A group is filled in turn, so the last entry wins, as with dcp.load."""
    spans = []
    for i, e in enumerate(entries):
        t = e.local
        if t.numel() == 0:
            continue
        lo = t.storage_offset() * t.element_size()
        extent = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))
        spans.append((str(t.device), t.untyped_storage().data_ptr(), lo, lo + extent * t.element_size(), i))
    spans.sort()
    first = list(range(len(entries)))  # each entry's group: the index of its group's first span's entry
    prev = None
    for dev, ptr, lo, hi, i in spans:
        if prev is not None and prev[:2] == (dev, ptr) and lo < prev[2]:
            first[i] = prev[3]
            prev = (dev, ptr, max(hi, prev[2]), prev[3])
        else:
            prev = (dev, ptr, hi, i)
    groups: dict[int, list[_Tensor]] = {}
    for i, e in enumerate(entries):
        groups.setdefault(first[i], []).append(e)
    return list(groups.values())


def load_state_dict(
    url: str,
    state_dict: Mapping[str, Any],
    *,
    group: dist.ProcessGroup | None = None,
    storage_options: dict | None = None,
) -> None:
    """Fill this rank's `state_dict` in place from the checkpoint at `url`; EVERY rank of `group`
    calls it. The state dict has the structure `save_state_dict` was given (e.g. from `get_state_dict`
    of a freshly built FSDP2 model and optimizer) at any world size: each DTensor's local shard
    receives exactly its rows (read straight from the byte ranges that hold them), plain tensors the
    whole tensor, and non-tensor values (hyperparameters) are replaced by the stored ones. Then call
    `set_state_dict` as after `dcp.load`.

    Top-level Stateful objects (an app state wrapping model and optimizer, an LR scheduler) are
    unwrapped with `state_dict()` and given the loaded values with `load_state_dict()`, as dcp.load
    does. Every tensor of the state dict must be in the checkpoint with its shape and dtype; the
    checkpoint may hold more (load the model alone from a model + optimizer save). Everything is
    checked on every rank before any byte is read, and a failure on any rank raises the same
    one-line error on all."""
    rank, world, ranks = _group(group)
    op = f"load_state_dict from {url}"
    here = Phase()
    state = None
    with here.at("check its state dict against the checkpoint"):
        ck = open_checkpoint(url, storage_options=storage_options)
        plain, objects = _unwrap_stateful(state_dict)
        state = _split(plain, rank, world, ranks)
        if not state.tensors and not state.values:
            raise LayoutError("the state dict is empty: nothing to load; pass the state dict to fill (get_state_dict "
                              "of the freshly built model and optimizer, a Stateful such as an LR scheduler)")
        _check_against(ck, state)
        values = _stored_values(ck, state.values)
    outcomes = _agree(op, group, here, digest=state.digest() if state is not None else None)
    assert state is not None  # _agree raised on every rank if any rank's check failed
    _require_same_structure(op, outcomes, state, world, group, "nothing was read")
    here = Phase()
    with here.at("read its shard"):
        _fill(ck, state)
        for leaf in state.values:
            leaf.container[leaf.index] = values[leaf.key]
        for _, obj, filled in objects:
            obj.load_state_dict(filled)
    _agree(op, group, here)
    empty = _stateless_optimizers(ck, objects) if rank == 0 else []
    if empty:
        warnings.warn(f"{op}: optimizer '{empty[0]}' has no state yet (never stepped), so none of the checkpoint's "
                      f"'{empty[0]}.state.*' tensors were loaded into it; pass get_state_dict(model, optim)'s "
                      "optimizer state dict instead, which initialises the state first", RuntimeWarning, stacklevel=2)

"""import-dcp: a DCP checkpoint -> a committed ragckpt checkpoint, streamed chunk by chunk, with the
world size, layout and model prefix chosen from the options, an export's record or the save itself."""

from __future__ import annotations

import base64
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ragckpt.args import check_flag
from ragckpt.checkpoint.manifest import DEFAULT_MAX_CHUNK_BYTES
from ragckpt.checkpoint.writer import (
    DEFAULT_MEMORY_BYTES,
    check_memory_budget,
    check_write_options,
    chunk_for_memory,
    default_workers,
    segment_fill,
    write_streaming,
)
from ragckpt.convert.dcp.keys import (
    MAX_CARRIED_BYTES,
    OPTIM_PREFIX,
    dcp_key_to_name,
    dcp_user_metadata,
    decode_bytes,
    detect_model_prefix,
    jsonable,
)
from ragckpt.convert.dcp.reader import DcpCheckpoint
from ragckpt.errors import (
    FormatError,
    LayoutError,
    OptionError,
)
from ragckpt.format.dtypes import itemsize
from ragckpt.planner.planner import GranularitySpec
from ragckpt.planner.state import CheckpointLayout
from ragckpt.storage.checksum import DEFAULT_BLOCK_BYTES
from ragckpt.storage.direct import ThreadBuffers
from ragckpt.storage.store import open_store

if TYPE_CHECKING:
    import torch
else:  # the CLI imports this module for its commands; torch comes in when one runs (see ragckpt.lazy)
    from ragckpt.lazy import torch

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



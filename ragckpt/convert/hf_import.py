"""Import a Hugging Face safetensors model (single file or sharded) into ragckpt, streaming.

Headers are parsed and validated first (a bad file fails with one line before anything is written),
then `write_streaming` builds every rank buffer chunk by chunk, each piece a byte-range read of the
source file at the tensor's data offset. Bytes are never converted, so every dtype (bf16 and fp8
included, NaN payloads and all) survives bit-exactly. The source's config.json is recorded so
`export_hf` can write it back.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from ragckpt.args import check_flag
from ragckpt.checkpoint.manifest import parse_json
from ragckpt.checkpoint.writer import (
    DEFAULT_MEMORY_BYTES,
    check_memory_budget,
    chunk_for_memory,
    default_workers,
    json_text_problem,
    write_streaming,
)
from ragckpt.errors import RESAVE_BIN_WEIGHTS, FormatError
from ragckpt.format.dtypes import itemsize
from ragckpt.format.names import is_model_weight
from ragckpt.planner.planner import GranularitySpec
from ragckpt.planner.state import CheckpointLayout
from ragckpt.storage.direct import ThreadBuffers
from ragckpt.storage.store import local_path, open_store

from .hf_export import HF_META_KEY, RESERVED_WEIGHTS_KEY
from .safetensors_io import (
    INDEX_NAME,
    SINGLE_NAME,
    Header,
    RangeFile,
    TensorEntry,
    natural_key,
    parse_header,
)


@dataclass
class ImportResult:
    dst: str
    world_size: int
    layout: str
    files: list[str]
    tensors: int
    bytes: int
    padding_bytes: int
    seconds: float
    dtypes: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class HFModel:
    """A parsed safetensors model: every tensor's file and byte span, validated."""

    root: str
    files: list[str]  # full paths/URLs
    headers: list[Header]
    entries: dict[str, tuple[int, TensorEntry]]  # name -> (file index, entry), in storage order
    config: dict | None
    _handles: list[RangeFile] = field(default_factory=list)  # open files, parallel to `files`

    def close(self) -> None:
        for f in self._handles:
            f.close()


#: a shard of a sharded Hugging Face checkpoint, as export-hf and transformers name them
_SHARD_NAME = re.compile(r"model-\d+-of-\d+\.safetensors")
_BIN_WEIGHTS = re.compile(r"pytorch_model[^/]*\.bin|[^/]*\.bin\.index\.json")


def _list_dir(url: str, storage_options: Mapping | None) -> tuple[str, list[str], Callable[[str], bytes] | None]:
    """(root, file names, reader of small files) for a local directory or an fsspec prefix."""
    path = local_path(url)
    if path is not None:
        if not os.path.exists(path):
            raise FormatError(f"{path}: no such file or directory")
        if not os.path.isdir(path):
            return path, [], None
        root = os.path.abspath(path)

        def read_local(name: str) -> bytes:
            with open(os.path.join(root, name), "rb") as f:
                return f.read()

        return root, sorted(os.listdir(root)), read_local

    root = url.rstrip("/")
    if root.endswith(".safetensors"):
        return root, [], None
    store = open_store(root, dict(storage_options or {}))
    names = sorted(k for k in store.list() if "/" not in k)
    if not names:
        raise FormatError(f"{url}: no such directory, or it is empty")
    return root, names, store.read


class _NonFiniteNumber(Exception):
    pass


def _refuse_constant(word: str) -> None:
    """Python's JSON parser takes NaN and Infinity; the checkpoint's metadata is strict JSON."""
    raise _NonFiniteNumber(word)


def open_hf_model(hf_dir: str, storage_options: Mapping | None = None) -> HFModel:
    """Find and validate the safetensors files of a model directory (or one .safetensors file):
    `model.safetensors.index.json` if present, else `model.safetensors`, else every `*.safetensors`."""
    root, listing, read_small = _list_dir(hf_dir, storage_options)
    join = (lambda n: os.path.join(root, n)) if "://" not in root else (lambda n: f"{root}/{n}")
    weight_map: dict[str, str] | None = None
    if read_small is None:  # a single file was given
        files = [root]
        root = os.path.dirname(root) if "://" not in root else root.rsplit("/", 1)[0]
    elif INDEX_NAME in listing:
        try:
            idx = parse_json(read_small(INDEX_NAME))
            weight_map = idx["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError
        except (ValueError, KeyError, TypeError):
            raise FormatError(f"{join(INDEX_NAME)}: not a valid index (needs a 'weight_map' object)") from None
        for name, fn in weight_map.items():
            if not isinstance(fn, str):
                raise FormatError(f"{join(INDEX_NAME)}: weight_map maps tensor '{name}' to {json.dumps(fn)}, which "
                                  "is not a file name; fix the index")
            if "/" in fn or fn not in listing:
                raise FormatError(f"{join(INDEX_NAME)}: weight_map refers to file '{fn}', which is not in {root}")
        names_in_order = sorted(set(weight_map.values()), key=natural_key)
        files = [join(fn) for fn in names_in_order]
    elif any(_SHARD_NAME.fullmatch(n) for n in listing):
        # export-hf (and transformers) write the index last: shards without it are an interrupted
        # export, whose files hold part of a model (or, after --overwrite, parts of two)
        shard = next(n for n in sorted(listing) if _SHARD_NAME.fullmatch(n))
        raise FormatError(f"{root} holds sharded files ({shard}, ...) but no {INDEX_NAME}: an interrupted export "
                          "leaves them so, holding part of a model; re-run the export, or give one file's path")
    elif SINGLE_NAME in listing:
        files = [join(SINGLE_NAME)]
    else:
        files = [join(n) for n in listing if n.endswith(".safetensors")]
        # a model's weights, not any .bin (Trainer leaves training_args.bin in its output directories)
        if not files and any(_BIN_WEIGHTS.fullmatch(n) for n in listing):
            raise FormatError(f"{root} holds PyTorch .bin weights, which import-hf does not read (they are pickles); "
                              f"{RESAVE_BIN_WEIGHTS} and import that")
        if not files:
            raise FormatError(f"{root}: no safetensors files (expected {INDEX_NAME}, {SINGLE_NAME} or *.safetensors)")
    handles = []
    try:
        headers = []
        for f in files:
            h = RangeFile(f, storage_options)
            handles.append(h)
            headers.append(parse_header(h))
        entries: dict[str, tuple[int, TensorEntry]] = {}
        for fi, h in enumerate(headers):
            for e in sorted(h.tensors.values(), key=lambda e: (e.begin, e.name)):
                if e.name in entries:
                    other = files[entries[e.name][0]]
                    raise FormatError(f"tensor '{e.name}' is stored twice: in {other} and in {files[fi]}")
                entries[e.name] = (fi, e)
        if weight_map is not None:
            base = [f.rsplit("/", 1)[-1] for f in files]
            for name, fn in weight_map.items():
                fi = base.index(fn)
                if name not in headers[fi].tensors:
                    raise FormatError(f"{join(INDEX_NAME)}: tensor '{name}' is mapped to {fn}, but that file "
                                      "does not contain it")
        if not entries:
            raise FormatError(f"{root}: the safetensors files hold no tensors")
        config = None
        if read_small is not None and "config.json" in listing:
            # export-hf writes the recorded config back; a garbled one would silently give a model
            # directory without config, so it is refused here, before anything is written
            try:
                config = parse_json(read_small("config.json"), parse_constant=_refuse_constant)
            except _NonFiniteNumber as e:
                raise FormatError(f"{join('config.json')} holds {e.args[0]}, which JSON does not allow and the "
                                  "checkpoint cannot record; fix or remove it") from None
            except ValueError:  # bad JSON, or bytes that are not UTF-8
                config = None
            if not isinstance(config, dict):
                raise FormatError(f"{join('config.json')} is not a JSON object; fix or remove it")
            why = json_text_problem(config, "config.json")
            if why:
                raise FormatError(f"{join('config.json')} cannot be recorded in the checkpoint ({why}); fix or remove it")
    except BaseException:
        for h in handles:
            h.close()
        raise
    return HFModel(root, files, headers, entries, config, handles)


def _rank_fill(lay: CheckpointLayout, bi: int, rank: int, model: HFModel,
               scratch: ThreadBuffers) -> Callable[[int, int], memoryview]:
    """Chunk source for one rank buffer: elements [lo, hi) assembled by byte-range reads of the
    source files straight into the calling thread's buffer of `scratch` (padding zeroed). Unlike
    the generic `segment_fill`, the reads of one chunk are batched per source file (`read_many`),
    which is what keeps S3 sources fast; like it, one reused buffer per thread keeps glibc from
    holding freed chunk-sized blocks (a fresh allocation per chunk measured 3-4x the budget)."""
    spec = lay.buffers[bi]
    seg = lay.layout_of(bi).rank_segments(rank)
    ends = seg.offset + seg.length
    isz = itemsize(spec.dtype)

    def fill(lo: int, hi: int) -> memoryview:
        n = (hi - lo) * isz
        zeros = scratch.take(n)
        mv = memoryview(zeros)
        pos = 0  # bytes of the chunk filled so far; gaps between tensors are padding
        reads: dict[int, list[tuple[int, memoryview]]] = {}  # per source file: (offset, destination)
        i0 = int(np.searchsorted(ends, lo, side="right"))
        i1 = int(np.searchsorted(seg.offset, hi, side="left"))
        for i in range(i0, i1):
            off, fs = int(seg.offset[i]), int(seg.flat_start[i])
            a, b = max(off, lo), min(int(ends[i]), hi)
            if b <= a:
                continue
            fi, e = model.entries[spec.tensors[int(seg.slot[i])]]
            start = (a - lo) * isz
            zeros[pos:start] = 0
            reads.setdefault(fi, []).append((e.begin + (fs + a - off) * isz, mv[start : (b - lo) * isz]))
            pos = (b - lo) * isz
        zeros[pos:] = 0
        for fi, reqs in reads.items():
            model._handles[fi].read_many(reqs)
        return mv

    return fill


def import_hf(
    hf_dir: str,
    dst: str,
    world_size: int,
    *,
    layout: str = "ragged",
    granularity: GranularitySpec = "row",
    overwrite: bool = False,
    memory_bytes: int = DEFAULT_MEMORY_BYTES,
    workers: int | None = None,
    storage_options: dict | None = None,
    progress: Callable[[int], None] | None = None,
) -> ImportResult:
    """Convert a Hugging Face safetensors model (single file or sharded with an index) into a
    committed ragckpt checkpoint for `world_size` ranks, laid out as `layout` ('ragged' plans with
    `granularity`, 'row' = FSDP2 Shard(0), 'element' = FSDP1/ZeRO flat). Streams: each rank buffer
    chunk is filled by byte-range reads of the source files, about `memory_bytes` in flight. The
    source's config.json (if any) is recorded in the checkpoint so `export_hf` can write it back.
    `dst` must not overlap `hf_dir`; a `dst` that holds anything is refused unless `overwrite`."""
    check_flag("overwrite", overwrite)
    t0 = time.perf_counter()
    if world_size <= 0:
        raise ValueError(f"--world-size must be positive, got {world_size}")
    check_memory_budget(memory_bytes)
    model = open_hf_model(hf_dir, storage_options)
    try:
        specs = {n: (e.shape, e.dtype) for n, (_, e) in model.entries.items()}
        lay = CheckpointLayout.build(specs, world_size, layout, granularity)
        nworkers = max(1, min(workers or default_workers(), world_size))
        chunk = chunk_for_memory(memory_bytes, nworkers)

        scratch = ThreadBuffers(chunk)

        def fill_for(bi: int, rank: int) -> Callable[[int, int], memoryview]:
            return _rank_fill(lay, bi, rank, model, scratch)

        hf_meta = {"source": model.root, "files": [f.rsplit("/", 1)[-1] for f in model.files],
                   "metadata": model.headers[0].metadata}
        if model.config is not None:
            hf_meta["config"] = model.config
        reserved = sorted(n for n in model.entries if not is_model_weight(n))
        if reserved:  # a submodule called `optim` or `extra`: still weights to export-hf
            hf_meta[RESERVED_WEIGHTS_KEY] = reserved
        # `sources`: DST must not be, contain or lie inside the model (--overwrite would delete it)
        write_streaming(dst, lay, fill_for, user={HF_META_KEY: hf_meta}, overwrite=overwrite,
                        storage_options=storage_options, max_chunk_bytes=chunk, workers=nworkers, progress=progress,
                        sources=[hf_dir])
    finally:
        model.close()
    dtypes: dict[str, int] = {}
    for _, e in model.entries.values():
        dtypes[e.dtype] = dtypes.get(e.dtype, 0) + 1
    data = lay.data_bytes()
    return ImportResult(dst=open_store(dst, storage_options).url, world_size=world_size, layout=layout, files=model.files, tensors=len(model.entries),
                        bytes=data, padding_bytes=lay.total_bytes() - data, seconds=time.perf_counter() - t0,
                        dtypes=dtypes)

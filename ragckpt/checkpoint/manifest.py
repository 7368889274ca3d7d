"""On-disk names and metadata documents of format v1 (docs/FORMAT.md is the specification).

Everything here is pure: it turns a `CheckpointLayout` into JSON documents and binary tables and
back, and names every object. Writers and readers share it so the two can never disagree.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import itertools
import json
import math
import operator
import platform
import re
import socket
import sys
import time
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ragckpt.errors import FormatError, LayoutError, RagckptError
from ragckpt.format.dtypes import itemsize, storage_dtype
from ragckpt.format.keys import COMMIT_KEY as COMMIT_KEY  # mf.COMMIT_KEY, beside the documents it marks
from ragckpt.format.keys import ROOT_META_KEY
from ragckpt.format.layout import layout_from_meta
from ragckpt.format.names import all_text
from ragckpt.format.placement import MAX_WORLD_SIZE, all_counts
from ragckpt.planner.state import BufferSpec, CheckpointLayout
from ragckpt.version import __version__

if TYPE_CHECKING:
    from ragckpt.storage.store import Store

FORMAT_NAME = "ragckpt"
FORMAT_VERSION = 1
DEFAULT_MAX_CHUNK_BYTES = 256 << 20
#: the largest checksum block and chunk object: readers allocate a block at a time
MAX_BLOCK_BYTES = 1 << 30
MAX_CHUNK_BYTES = 1 << 42
#: element counts, offsets and sizes are int64 everywhere
_MAX_COUNT = (1 << 63) - 1


def buffer_key(buffer: int) -> str:
    return f"buffers/{buffer}"


def chunk_key(buffer: int, rank: int, chunk: int) -> str:
    """Rank `rank`'s chunk `chunk` of a buffer: the zarr v3 key of chunk (rank, chunk) of a (W, Smax)
    array with the "." separator, so all chunks of a buffer share one directory (a directory per
    rank costs a mkdir each: seconds at 8,192 ranks on a local disk)."""
    return f"buffers/{buffer}/c.{rank}.{chunk}"


def holds_rank_objects(store: Store, under: str = "") -> bool:
    """Whether `store` (or its folder `under`) holds objects that ranks write, their records or
    buffer chunks: part of a checkpoint, with or without the root document rank 0 writes. Judged by
    the objects' names, so an unrelated folder merely called `buffers` is not taken for one."""
    base = f"{under}/" if under else ""
    for sub in ("ranks", "buffers"):  # ranks/ first: one short listing settles most cases
        if any(is_rank_object(k[len(base):]) for k in store.list(base + sub)):
            return True
    return False


def is_rank_object(key: str) -> bool:
    """Whether `key` (relative to a checkpoint's root) names an object only a rank writes: its
    record (`ranks/<r>.json`) or a chunk of its buffer (`buffers/<b>/c.<r>.<j>`)."""
    return bool(_RANK_NAME.match(key) or _CHUNK_NAME.match(key))


def root_doc_kind(raw: bytes) -> str:
    """What a zarr.json is, from its bytes alone: "manifest" (a ragckpt checkpoint's root, possibly
    damaged inside), "array" (one of a checkpoint's own arrays, ragckpt attributes without the
    manifest's fields), "zarr" (valid JSON without ragckpt attributes: a plain zarr group or array)
    or "invalid" (not JSON)."""
    try:
        doc = parse_json(raw)
    except ValueError:
        return "invalid"
    attrs = doc.get("attributes") if isinstance(doc, dict) else None
    m = attrs.get(FORMAT_NAME) if isinstance(attrs, dict) else None
    if not isinstance(m, dict):
        return "zarr"
    if "buffer" in m and not {"format", "format_version", "world_size", "layouts"} & m.keys():
        return "array"
    return "manifest"


def rank_manifest_key(rank: int) -> str:
    return f"ranks/{rank}.json"


def extra_key(rank: int) -> str:
    return f"extra/{rank}.safetensors"


_CHUNK_NAME = re.compile(r"^buffers/(\d+)/c\.(\d+)\.(\d+)$")
_EXTRA_NAME = re.compile(r"^extra/(\d+)\.safetensors$")
_RANK_NAME = re.compile(r"^ranks/(\d+)\.json$")
_BUFFER_DOC_NAME = re.compile(r"^buffers/(\d+)/zarr\.json$")
_TABLE_NAME = re.compile(r"^meta/(units|crc)/(\d+)/")


def stray_objects(keys: Iterable[str], layout: CheckpointLayout, max_chunk_bytes: int, block_bytes: int,
                  has_extra: np.ndarray, units_layouts: Collection[int] = ()) -> list[str]:
    """Objects named like checkpoint data that this checkpoint does not hold: chunks past a rank's
    buffer or of buffers and ranks it does not have, extras of ranks that saved none, records of
    ranks past the world size, and the array documents and metadata tables of buffers and layouts
    it does not have (`units_layouts`: the layouts that have a units table). An earlier save
    attempt into the same directory (another layout, another world size, more buffers) leaves them;
    ragckpt never reads them, but plain zarr would list a stray buffer as an array of zeros, serve a
    stray chunk's bytes as that rank's data, and a reader going by file names the stale extras."""
    W = layout.world_size
    n_buffers = len(layout.buffers)
    units = set(units_layouts)
    counts = []
    for bi in range(len(layout.buffers)):
        counts.append(buffer_chunking(layout, bi, max_chunk_bytes, block_bytes).counts(layout.rank_sizes(bi)))
    out = []
    for k in keys:
        m = _CHUNK_NAME.match(k)
        if m:
            b, r, j = (int(x) for x in m.groups())
            if b >= len(counts) or r >= W or j >= int(counts[b][r]):
                out.append(k)
            continue
        m = _EXTRA_NAME.match(k)
        if m and (int(m.group(1)) >= W or int(has_extra[int(m.group(1))]) < 0):
            out.append(k)
            continue
        m = _RANK_NAME.match(k)
        if m and int(m.group(1)) >= W:
            out.append(k)
            continue
        m = _BUFFER_DOC_NAME.match(k)
        if m and int(m.group(1)) >= n_buffers:
            out.append(k)
            continue
        m = _TABLE_NAME.match(k)
        if m and (int(m.group(2)) not in units if m.group(1) == "units" else int(m.group(2)) >= n_buffers):
            out.append(k)
    return sorted(out)


@dataclass(frozen=True)
class Chunking:
    """A buffer is stored as a zarr array of shape (W, Smax) with chunks (1, chunk_elems): rank r
    writes chunks (r, 0..count(S_r)-1), the last one zero-padded to full size as zarr stores
    chunks; chunks past S_r are never written (zarr reads them as the fill value 0)."""

    chunk_elems: int
    itemsize: int

    @property
    def chunk_bytes(self) -> int:
        return self.chunk_elems * self.itemsize

    def count(self, nelems: int) -> int:
        return -(-int(nelems) // self.chunk_elems)

    def counts(self, nelems: np.ndarray) -> np.ndarray:
        """`count` of every rank's buffer at once."""
        return -(-np.asarray(nelems, dtype=np.int64) // self.chunk_elems)


def chunking(max_elems: int, dtype: str, max_chunk_bytes: int, block_bytes: int) -> Chunking:
    """One chunk per rank when the largest rank buffer fits in `max_chunk_bytes`, else equal chunks
    that are whole checksum blocks (so a block never straddles two objects)."""
    isz = itemsize(dtype)
    nbytes = max_elems * isz
    if max_elems == 0:
        return Chunking(1, isz)
    if nbytes <= max_chunk_bytes:
        return Chunking(int(max_elems), isz)
    count = -(-nbytes // max_chunk_bytes)
    unit = math.lcm(block_bytes, isz)
    per_chunk = -(-nbytes // count)
    return Chunking((-(-per_chunk // unit) * unit) // isz, isz)


def buffer_chunking(layout: CheckpointLayout, buffer: int, max_chunk_bytes: int, block_bytes: int) -> Chunking:
    """The chunk grid of one buffer array, set by its largest rank. O(W): compute it once per buffer,
    never once per rank or request."""
    return chunking(int(layout.rank_sizes(buffer).max()), layout.buffers[buffer].dtype, max_chunk_bytes, block_bytes)


def block_counts(nbytes: np.ndarray, block_bytes: int) -> np.ndarray:
    return -(-np.asarray(nbytes, dtype=np.int64) // block_bytes)


# -- zarr v3 documents --------------------------------------------------------------------------------

def _dumps(doc: dict) -> bytes:
    return json.dumps(doc, indent=1, sort_keys=True).encode()


def group_doc(attributes: dict | None = None) -> bytes:
    return _dumps({"zarr_format": 3, "node_type": "group", "attributes": attributes or {}})


def array_doc(shape: tuple[int, ...], dtype: np.dtype, chunk_shape: tuple[int, ...], attributes: dict,
              compressed: bool = False, separator: str = "/") -> bytes:
    """A zarr v3 array document; chunks are raw little-endian bytes (optionally zstd for metadata tables)."""
    codecs: list[dict] = [{"name": "bytes", "configuration": {"endian": "little"}}]
    if compressed:
        codecs.append({"name": "zstd", "configuration": {"level": 3, "checksum": False}})
    fill = False if dtype == np.bool_ else [0.0, 0.0] if np.dtype(dtype).kind == "c" else 0  # zarr v3: complex fill is a pair
    return _dumps({
        "zarr_format": 3,
        "node_type": "array",
        "shape": list(shape),
        "data_type": np.dtype(dtype).name,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunk_shape)}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": separator}},
        "fill_value": fill,
        "codecs": codecs,
        "attributes": attributes,
        "storage_transformers": [],
        "dimension_names": None,
    })


def buffer_array_doc(spec: BufferSpec, world_size: int, max_elems: int, ch: Chunking) -> bytes:
    """The zarr.json of one buffer's (W, Smax) array. Deterministic, so `verify` can regenerate it."""
    return array_doc(
        (world_size, int(max_elems)), storage_dtype(spec.dtype), (1, ch.chunk_elems),
        {"ragckpt": {"buffer": spec.name, "dtype": spec.dtype,
                     "note": "row r holds rank r's flat buffer; its length is in the root manifest"}},
        separator=".",
    )


@functools.lru_cache(maxsize=256)
def table_array_doc(shape: tuple[int, ...], dtype: np.dtype, *, compressed: bool = False) -> bytes:
    """The zarr.json of a single-chunk metadata table. Deterministic, so readers regenerate it from the
    shape the manifest implies and compare: the documents are not covered by `COMMITTED`'s checksums.
    Cached: json.dumps with `indent` runs the pure-Python encoder, and rendering the three documents
    was a fifth of every `ragckpt.open` (a restore opens the checkpoint once per rank)."""
    return array_doc(shape, dtype, tuple(max(1, int(s)) for s in shape), {}, compressed=compressed)


# -- root manifest ----------------------------------------------------------------------------------

@functools.cache
def _torch_version() -> str:
    """torch's version without importing torch when nothing else has (see ragckpt.lazy)."""
    loaded = sys.modules.get("torch")
    if loaded is not None:
        return str(loaded.__version__)
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def creation_info() -> dict:
    return {
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": socket.gethostname(),
        "ragckpt_version": __version__,
        "torch_version": _torch_version(),
        "python": platform.python_version(),
    }


def layout_to_manifest(lay: CheckpointLayout, *, block_bytes: int, max_chunk_bytes: int,
                       user: dict | None, save_id: str | None = None) -> tuple[dict, dict[int, np.ndarray]]:
    """Root manifest (JSON) and the per-tensor unit tables that per-tensor layouts need."""
    if lay.world_size > MAX_WORLD_SIZE:  # readers refuse more: never write what cannot be read back
        raise LayoutError(f"world size {lay.world_size:,} is above the format's limit of {MAX_WORLD_SIZE:,} ranks")
    layouts = []
    tables: dict[int, np.ndarray] = {}
    for i, bl in enumerate(lay.layouts):
        meta, bins = bl.to_meta()
        entry = {**meta, "shapes": [list(s) for s in bl.shapes], "dims": list(bl.dims)}
        if meta["family"] == "flat":
            entry["offsets"] = list(bl.offsets)  # type: ignore[attr-defined]
        if "units" in bins:
            tables[i] = np.asarray(bins["units"], dtype=np.int64)  # the layout's own table, not a copy
            entry["units"] = {"array": f"meta/units/{i}", "shape": list(bins["units"].shape)}
        layouts.append(entry)
    manifest = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "world_size": lay.world_size,
        "layout": lay.kind,
        "block_bytes": block_bytes,
        "max_chunk_bytes": max_chunk_bytes,
        "created": creation_info(),
        # keys as JSON stores them ("0" for 0, as in a config's id2label), so sorting never meets a mix
        "user": json.loads(json.dumps(user or {})),
        "layouts": layouts,
        "buffers": [
            {"name": b.name, "dtype": b.dtype, "storage_dtype": storage_dtype(b.dtype).name,
             "layout": b.layout, "tensors": list(b.tensors)}
            for b in lay.buffers
        ],
    }
    if save_id is not None:
        manifest["save_id"] = save_id
    return manifest, tables


#: the manifest fields every rank of one save must agree on (rank 0 alone writes the manifest)
_FINGERPRINT_FIELDS = ("world_size", "layout", "block_bytes", "max_chunk_bytes", "layouts", "buffers", "save_id")


def layout_fingerprint(manifest: dict, tables: Mapping[int, np.ndarray]) -> str:
    """A digest of what the ranks of one save must share: the layout (tensor order, shapes, units,
    offsets), the chunking and the optional save id. Each rank records it; `commit` refuses a rank
    whose record was written for anything else, which would otherwise be read as this layout."""
    h = hashlib.sha256(json.dumps({k: manifest.get(k) for k in _FINGERPRINT_FIELDS}, sort_keys=True).encode())
    for i in sorted(tables):
        table = np.ascontiguousarray(tables[i], dtype="<i8")
        h.update(memoryview(table).cast("B") if table.size else b"")  # no copy of a large table
    return h.hexdigest()[:32]


def parse_json(raw: bytes | str, **kw: Any) -> object:
    """`json.loads` (with `kw`) whose every failure is a ValueError: a document nested a million
    levels deep (damage, or a hostile file) raises RecursionError from the parser."""
    try:
        return json.loads(raw, **kw)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def shorten(text: str, width: int) -> str:
    """`text` cut to `width` characters, the cut marked with '...'."""
    return text if len(text) <= width else text[: width - 3] + "..."


def brief(value: object, width: int = 60) -> str:
    """`repr(value)` cut to one short line, for error messages about damaged metadata."""
    return shorten(repr(value), width)


def manifest_from_root_doc(raw: bytes, url: str) -> dict:
    try:
        doc = parse_json(raw)
    except ValueError:
        raise FormatError(f"{url}/zarr.json is not valid JSON; the checkpoint metadata is corrupt") from None
    attrs = doc.get("attributes") if isinstance(doc, dict) else None
    m = attrs.get(FORMAT_NAME) if isinstance(attrs, dict) else None
    if not isinstance(m, dict):
        raise FormatError(f"{url}/zarr.json is not a ragckpt manifest (no 'ragckpt' attributes); check the path")
    if m.get("format") != FORMAT_NAME:
        raise FormatError(f"{url}/zarr.json: manifest field 'format' is {brief(m.get('format'))}, expected "
                          f"'{FORMAT_NAME}'; the checkpoint metadata is corrupt")
    version = m.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise FormatError(f"{url}/zarr.json: manifest field 'format_version' is {brief(version)}, expected a "
                          "positive integer; the checkpoint metadata is corrupt")
    if version != FORMAT_VERSION:
        raise FormatError(
            f"{url} has checkpoint format version {version!r}; this ragckpt reads version {FORMAT_VERSION} "
            "(upgrade ragckpt or convert the checkpoint)"
        )
    _check_manifest_fields(m, url)
    return m


def parse_marker(raw: bytes) -> tuple[dict, dict[str, int]]:
    """The commit marker's document and its `{object key: crc32c}` table; ValueError when it is not
    one (not JSON, no table, no entry for the root document, a checksum that is not an integer)."""
    try:
        doc = parse_json(raw)
        expected = {str(k): v for k, v in doc["objects_crc32c"].items()}  # type: ignore[index]
    except (KeyError, TypeError, AttributeError):
        raise ValueError("not a commit marker") from None
    if ROOT_META_KEY not in expected or not all(is_crc(v) for v in expected.values()):
        raise ValueError("not a commit marker")
    return doc, expected  # type: ignore[return-value]


def is_crc(v: object) -> bool:
    """A crc32c as the marker and the rank documents record it: an integer, not a string or float."""
    return is_count(v, 0, 0xFFFFFFFF)


def is_count(v: object, lo: int = 0, hi: int = _MAX_COUNT) -> bool:
    """An integer in [lo, hi] as JSON gives it: not a bool, float or numeric string."""
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _check_manifest_fields(m: dict, url: str) -> None:
    """Every field a reader indexes or computes with, with its JSON type and range: a damaged
    manifest (only an uncommitted one can be, unnoticed by the checksums, or one whose marker was
    rewritten to match) is then one clear error, never a traceback, a huge allocation, or a shape
    read from a string one character at a time."""

    def bad(field_: str, v: object, want: str) -> FormatError:
        return FormatError(f"{url}/zarr.json: manifest field '{field_}' is {brief(v)}, expected {want}; the "
                           "checkpoint metadata is corrupt")

    limits = {"world_size": (1, MAX_WORLD_SIZE), "block_bytes": (1, MAX_BLOCK_BYTES),
              "max_chunk_bytes": (1, MAX_CHUNK_BYTES)}
    for key, (lo, hi) in limits.items():
        if not is_count(m.get(key), lo, hi):
            raise bad(key, m.get(key), f"an integer from {lo} to {hi:,}")
    for key, typ, what in (("layout", str, "a string"), ("layouts", list, "a list"), ("buffers", list, "a list")):
        if not isinstance(m.get(key), typ):
            raise bad(key, m.get(key), what)
    for key in ("user", "created"):
        if key in m and not isinstance(m[key], dict):
            raise bad(key, m[key], "an object")
    if "save_id" in m and not isinstance(m["save_id"], str):
        raise bad("save_id", m["save_id"], "a string")
    for i, e in enumerate(m["layouts"]):
        where = f"layouts[{i}]"
        if not isinstance(e, dict):
            raise bad(where, e, "an object")
        shapes, dims = e.get("shapes"), e.get("dims")
        if not isinstance(shapes, list) or not set(map(type, shapes)) <= {list} \
                or not all_counts(list(itertools.chain.from_iterable(shapes)), 0, _MAX_COUNT):
            raise bad(f"{where}.shapes", shapes, "a list of shapes (lists of non-negative integers)")
        if max(map(math.prod, shapes), default=0) > _MAX_COUNT:
            raise bad(f"{where}.shapes", shapes, "shapes of fewer than 2**63 elements")
        if not isinstance(dims, list) or len(dims) != len(shapes) or not all_counts(dims, 0, _MAX_COUNT) \
                or not all(map(operator.le, dims, map(len, shapes))):
            raise bad(f"{where}.dims", dims, "one integer per tensor, from 0 to its number of dimensions")
        family = e.get("family")
        if family == "flat":
            offsets = e.get("offsets")
            if not isinstance(offsets, list) or len(offsets) != len(shapes) or not all_counts(offsets, 0, _MAX_COUNT):
                raise bad(f"{where}.offsets", offsets, "one non-negative integer per tensor")
            if not is_count(e.get("shard_size")):
                raise bad(f"{where}.shard_size", e.get("shard_size"), "a non-negative integer")
        elif family == "per_tensor":
            want = {"array": f"meta/units/{i}", "shape": [len(shapes), m["world_size"]]}
            if e.get("units") != want:  # readers open the table by that path, with that shape
                raise bad(f"{where}.units", e.get("units"), json.dumps(want))
        else:
            raise bad(f"{where}.family", family, "'flat' or 'per_tensor'")
        family_of_kind = {"ragged": "flat", "element": "flat", "row": "per_tensor"}.get(m["layout"])
        if family_of_kind not in (None, family):
            raise bad(f"{where}.family", family, f"'{family_of_kind}', as every layout of a '{m['layout']}' checkpoint")
    for i, b in enumerate(m["buffers"]):
        where = f"buffers[{i}]"
        if not isinstance(b, dict):
            raise bad(where, b, "an object")
        if not isinstance(b.get("name"), str):  # "" is a name writers have always accepted
            raise bad(f"{where}.name", b.get("name"), "a string")
        if not isinstance(b.get("dtype"), str) or not b.get("dtype"):
            raise bad(f"{where}.dtype", b.get("dtype"), "a dtype name")
        try:
            stored = storage_dtype(b["dtype"]).name
        except RagckptError:  # an unknown dtype: the layout names it (layout_from_manifest)
            stored = b.get("storage_dtype")
        if b.get("storage_dtype") != stored:  # a plain zarr reader takes the buffer's bytes as this dtype
            raise bad(f"{where}.storage_dtype", b.get("storage_dtype"), f"'{stored}' for dtype '{b['dtype']}'")
        if not is_count(b.get("layout"), 0, len(m["layouts"]) - 1):
            raise bad(f"{where}.layout", b.get("layout"), f"the index of one of the {len(m['layouts'])} layouts")
        tensors = b.get("tensors")
        if not isinstance(tensors, list) or not set(map(type, tensors)) <= {str} or not all_text(tensors):
            raise bad(f"{where}.tensors", tensors, "a list of tensor names")


def layout_from_manifest(m: dict, tables: dict[int, np.ndarray], url: str) -> CheckpointLayout:
    """The layout a manifest checked by `manifest_from_root_doc` describes. Its parts can still
    contradict each other (tensors that do not fit the shard size, a units table that does not cover
    a tensor): that is reported as damage to the checkpoint at `url`, not as a layout to re-plan."""
    try:
        W = m["world_size"]
        layouts = []
        for i, e in enumerate(m["layouts"]):
            shapes = tuple(tuple(s) for s in e["shapes"])
            layouts.append(layout_from_meta(e, W, shapes, tuple(e["dims"]), tuple(e.get("offsets", ())),
                                            {"units": tables[i]} if i in tables else {}))
        buffers = [BufferSpec(b["name"], b["dtype"], b["layout"], tuple(b["tensors"])) for b in m["buffers"]]
        return CheckpointLayout(W, m["layout"], layouts, buffers)
    except (RagckptError, KeyError, TypeError, ValueError, OverflowError) as e:
        what = f"missing field {e}" if isinstance(e, KeyError) else str(e.args[0] if e.args else e)
        raise FormatError(f"{url}/zarr.json describes an inconsistent layout ({shorten(what, 160)}); the checkpoint "
                          "metadata is corrupt: restore it or re-save the checkpoint") from None

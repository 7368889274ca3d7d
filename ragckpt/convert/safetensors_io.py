"""The safetensors container, read and written in pieces.

`safetensors.torch.save_file` needs every tensor in memory at once and `load_file` materialises the
whole file; a converter between a sharded checkpoint and a multi-GiB model cannot afford either. The
format is simple enough to stream: an 8-byte little-endian header length N, N bytes of JSON
(`{"__metadata__": {...}, name: {"dtype", "shape", "data_offsets": [begin, end]}}`, padded with
spaces), then the tensors' bytes, row-major, back to back with no holes. So a writer can lay out
every offset first, write the header, then fill each tensor block by block at its offset; a reader
parses the header once and turns "elements [a, b) of tensor t" into one byte-range read.

This module holds that container logic: header parsing with validation that names the file and
tensor on every failure, header construction, and byte-range access to local or fsspec files.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from ragckpt.errors import BadObjectError, FormatError
from ragckpt.format.dtypes import DTYPE_TO_ST, ST_TO_DTYPE, itemsize
from ragckpt.format.names import is_text
from ragckpt.format.placement import MAX_NUMEL, numel_of
from ragckpt.storage.store import local_path, open_store


def st_dtype_code(name: str, dtype: str) -> str:
    """The safetensors dtype code for tensor `name` of logical dtype `dtype`; a dtype the format
    cannot hold (complex128) is refused with one line naming the tensor."""
    try:
        return DTYPE_TO_ST[dtype]
    except KeyError:
        raise FormatError(f"tensor '{name}' is {dtype}, which safetensors cannot store; leave it out with "
                          "--include or convert it to a supported dtype (export-dcp keeps every dtype)") from None

# safetensors' own parser refuses headers above 100 MB; so do we, before allocating anything
MAX_HEADER_BYTES = 100_000_000
METADATA_KEY = "__metadata__"
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file: where its bytes are, relative to the file start."""

    name: str
    dtype: str  # ragckpt logical dtype name
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int

    @property
    def numel(self) -> int:
        return numel_of(self.shape)

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class Header:
    path: str
    data_start: int  # 8 + header length
    file_size: int
    metadata: dict[str, str]
    tensors: dict[str, TensorEntry]


# -- reading ------------------------------------------------------------------------------------------------

class RangeFile:
    """Byte-range reads of one file, local (`os.preadv` straight into the caller's buffer) or any
    fsspec URL (s3://...). Thread-safe: positional reads share no file position."""

    def __init__(self, url: str, storage_options: Mapping | None = None):
        self.url = url
        self._fd: int | None = None
        path = local_path(url)
        if path is not None:
            url = path
            try:
                self._fd = os.open(url, os.O_RDONLY)
            except FileNotFoundError:
                raise FormatError(f"{url}: no such file") from None
            except IsADirectoryError:
                raise FormatError(f"{url}: is a directory, not a safetensors file") from None
            st = os.fstat(self._fd)
            if stat.S_ISDIR(st.st_mode):  # opening a directory read-only succeeds; reading it fails later
                os.close(self._fd)
                self._fd = None
                raise FormatError(f"{url} is a directory, not a safetensors file; check the model directory")
            self.size = st.st_size
        else:  # object storage through ragckpt's store: its retries and request limits apply
            parent, _, self._key = url.rstrip("/").rpartition("/")
            self._store = open_store(parent, dict(storage_options or {}))
            try:
                self.size = int(self._store.size(self._key))
            except BadObjectError:  # only a missing object: an outage or refused credentials say so themselves
                raise FormatError(f"{url}: no such file") from None

    def read_into(self, offset: int, out: memoryview) -> None:
        """Fill `out` (a writable byte view) with the file's bytes from `offset`."""
        n = len(out)
        if offset < 0 or offset + n > self.size:
            raise FormatError(f"{self.url}: read of bytes [{offset}, {offset + n}) is past the end of the "
                              f"file ({self.size} bytes); the file is truncated")
        if self._fd is not None:
            got = 0
            while got < n:
                k = os.preadv(self._fd, [out[got:]], offset + got)
                if k <= 0:
                    raise FormatError(f"{self.url}: file shrank while reading (ends at {offset + got})")
                got += k
            return
        if n:
            out[:] = self._store.read_range(self._key, offset, offset + n)

    def read_many(self, reqs: Sequence[tuple[int, memoryview]]) -> None:
        """Several `read_into`s; on object storage they go out as one concurrent batch."""
        if self._fd is not None or len(reqs) < 2:
            for off, out in reqs:
                self.read_into(off, out)
            return
        for off, out in reqs:
            if off < 0 or off + len(out) > self.size:
                raise FormatError(f"{self.url}: read of bytes [{off}, {off + len(out)}) is past the end of the "
                                  f"file ({self.size} bytes); the file is truncated")
        got = self._store.read_ranges([(self._key, off, off + len(out)) for off, out in reqs])
        for (_, out), data in zip(reqs, got, strict=True):
            out[:] = data

    def read(self, offset: int, n: int) -> bytes:
        buf = bytearray(n)
        self.read_into(offset, memoryview(buf))
        return bytes(buf)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RangeFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def fsspec_options(storage_options: Mapping | None) -> dict:
    """Storage options for a direct fsspec call: ragckpt's own `ragckpt` entry (I/O tuning read by
    its stores) is not an fsspec argument and would be forwarded to botocore, which rejects it."""
    return {k: v for k, v in dict(storage_options or {}).items() if k != "ragckpt"}


class DuplicateKeyError(ValueError):
    pass


def unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """json object hook: a key given twice (the second would silently win) is an error."""
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise DuplicateKeyError(k)
        out[k] = v
    return out


def _is_count(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_header(f: RangeFile) -> Header:
    """Parse and validate a safetensors header. Every failure is one `FormatError` line naming the
    file (and tensor), so a bad input is diagnosed before any data is copied."""
    p = f.url
    if f.size < 8:
        raise FormatError(f"{p}: not a safetensors file ({f.size} bytes, shorter than the 8-byte header length)")
    head = f.read(0, min(9, f.size))
    n = int.from_bytes(head[:8], "little")
    if len(head) > 8 and head[8:9] != b"{":  # the JSON header always opens with '{'
        raise FormatError(f"{p}: not a safetensors file (no JSON header after the 8-byte length)")
    if n > MAX_HEADER_BYTES:
        raise FormatError(f"{p}: not a safetensors file (header length field says {n} bytes)")
    if 8 + n > f.size:
        raise FormatError(f"{p}: truncated header: it claims {n} bytes but the file has only {f.size - 8} after "
                          "the length field")
    raw = f.read(8, n)
    try:
        doc = json.loads(raw.decode("utf-8"), object_pairs_hook=unique_keys)
    except DuplicateKeyError as e:
        raise FormatError(f"{p}: its header lists '{e.args[0]}' twice; the file is corrupt") from None
    except (UnicodeDecodeError, ValueError):
        raise FormatError(f"{p}: not a safetensors file (its header is not JSON)") from None
    if not isinstance(doc, dict):
        raise FormatError(f"{p}: not a safetensors file (header is not a JSON object)")
    data_start = 8 + n
    meta = doc.pop(METADATA_KEY, None)
    if meta is None:  # absent, or null, as safetensors' own loader accepts
        meta = {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise FormatError(f"{p}: __metadata__ must be a JSON object of strings")
    if not all(is_text(k) and is_text(v) for k, v in meta.items()):
        raise FormatError(f"{p}: __metadata__ holds text that is not valid Unicode (a lone surrogate escape); "
                          "the header is corrupt")
    tensors: dict[str, TensorEntry] = {}
    for name, e in doc.items():
        # exactly the types safetensors accepts: a float offset or a string shape is a lying header
        try:
            code, shape, offsets = e["dtype"], e["shape"], e["data_offsets"]
        except (KeyError, TypeError):
            code, shape, offsets = None, None, None
        if (not isinstance(code, str) or not isinstance(shape, list) or not all(map(_is_count, shape))
                or not isinstance(offsets, list) or len(offsets) != 2 or not all(map(_is_count, offsets))):
            raise FormatError(f"{p}: tensor '{name}' has a malformed header entry")
        shape, (b, en) = tuple(shape), offsets
        if not is_text(name):
            raise FormatError(f"{p}: tensor name {ascii(name)} is not valid UTF-8 (a lone surrogate), which "
                              "safetensors does not allow; the file is corrupt")
        if code not in ST_TO_DTYPE:
            raise FormatError(f"{p}: tensor '{name}' has dtype {code}, which ragckpt does not support "
                              f"(supported: {', '.join(ST_TO_DTYPE)})")
        dt = ST_TO_DTYPE[code]
        if any(s < 0 for s in shape):
            raise FormatError(f"{p}: tensor '{name}' has a negative dimension in shape {list(shape)}")
        if any(s >= MAX_NUMEL for s in shape):
            raise FormatError(f"{p}: tensor '{name}' has a dimension of 2**62 or more in shape {list(shape)}, "
                              "which ragckpt cannot address; the header is corrupt")
        ent = TensorEntry(name, dt, shape, data_start + b, data_start + en)
        if b < 0 or en < b or ent.nbytes != ent.numel * itemsize(dt):
            raise FormatError(f"{p}: tensor '{name}' data_offsets [{b}, {en}) do not match its shape "
                              f"{list(shape)} and dtype {code}")
        if ent.end > f.size:
            raise FormatError(f"{p}: tensor '{name}' data_offsets [{b}, {en}) run past the end of the file "
                              f"(data section has {f.size - data_start} bytes); the file is truncated")
        tensors[name] = ent
    spans = sorted((t.begin, t.end, t.name) for t in tensors.values() if t.nbytes)
    for (_, e0, n0), (b1, _, n1) in zip(spans, spans[1:], strict=False):
        if b1 < e0:
            raise FormatError(f"{p}: tensors '{n0}' and '{n1}' overlap in the data section")
    # the tensors tile the data section exactly, as safetensors requires: a hole or bytes after the
    # last tensor mean the header does not describe the file
    end = data_start
    for b, e, name in spans:
        if b != end:
            raise FormatError(f"{p}: {b - end} bytes before tensor '{name}' belong to no tensor; the header does "
                              "not describe the file (corrupt or not written by a safetensors writer)")
        end = e
    if end != f.size:
        raise FormatError(f"{p}: {f.size - end} bytes after the last tensor belong to no tensor; the header does "
                          "not describe the file (corrupt, or two files concatenated)")
    return Header(p, data_start, f.size, {str(k): str(v) for k, v in meta.items()}, tensors)


# -- writing ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class OutTensor:
    """A tensor as it will be stored in an output file."""

    name: str
    dtype: str  # logical dtype name (after any cast)
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * itemsize(self.dtype)


def build_header(tensors: Sequence[OutTensor], metadata: Mapping[str, str] | None = None) -> tuple[bytes, list[int]]:
    """Header bytes (length prefix included, JSON padded with spaces to a multiple of 8, so the data
    section starts 8-aligned) and each tensor's absolute byte offset, tensors stored in the given
    order."""
    doc: dict[str, object] = {}
    if metadata is not None:
        doc[METADATA_KEY] = {str(k): str(v) for k, v in metadata.items()}
    pos = 0
    rel = []
    for t in tensors:
        doc[t.name] = {"dtype": st_dtype_code(t.name, t.dtype), "shape": list(t.shape), "data_offsets": [pos, pos + t.nbytes]}
        rel.append(pos)
        pos += t.nbytes
    js = json.dumps(doc, separators=(",", ":")).encode("utf-8")
    js += b" " * (-len(js) % 8)
    data_start = 8 + len(js)
    return len(js).to_bytes(8, "little") + js, [data_start + r for r in rel]


def storage_order(tensors: Iterable[OutTensor]) -> list[OutTensor]:
    """Order inside one file: wider dtypes first, then natural name order. With an 8-aligned data
    section this keeps every tensor aligned to its element size (zero-copy mmap loads), which is also
    why safetensors itself sorts by alignment."""
    return sorted(tensors, key=lambda t: (-itemsize(t.dtype), natural_key(t.name)))


_DIGITS = re.compile(r"(\d+)")


def natural_key(name: str) -> tuple:
    """`layers.2` before `layers.10`: shards then follow the model's layer order."""
    # isdecimal, not isdigit: '²' is a digit to str.isdigit but not to \d, and int() refuses it
    return tuple(int(p) if p.isdecimal() else p for p in _DIGITS.split(name))


def assign_shards(tensors: Sequence[OutTensor], max_shard_bytes: int) -> list[list[OutTensor]]:
    """Fill shards in order like Hugging Face: a tensor that would overflow the current shard starts
    a new one; a tensor bigger than the limit gets a shard of its own."""
    shards: list[list[OutTensor]] = []
    cur: list[OutTensor] = []
    size = 0
    for t in tensors:
        if cur and size + t.nbytes > max_shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(t)
        size += t.nbytes
    if cur or not shards:
        shards.append(cur)
    return shards


def shard_file_names(count: int) -> list[str]:
    if count == 1:
        return [SINGLE_NAME]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]

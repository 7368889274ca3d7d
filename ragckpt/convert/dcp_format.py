"""The PyTorch DCP on-disk format, read and written without a process group and without loading files.

A DCP checkpoint directory holds one pickled `.metadata` (a `torch.distributed.checkpoint.metadata.
Metadata`) and `.distcp` files. `Metadata.storage_data` maps every `MetadataIndex(fqn, chunk offsets)`
to `_StorageInfo(relative_path, offset, length)`: a byte range of one `.distcp` file. With the default
`FileSystemWriter` (torch_save serialisation) a tensor chunk's byte range is a complete `torch.save`
zip archive of that chunk, and a non-tensor ("bytes") entry is a `torch.save` of the Python object.

This module reads both without trusting or materialising them:

* `load_metadata` unpickles `.metadata` with an allow-list (only the DCP dataclasses, `torch.Size`,
  dtypes and paths), so a hostile file cannot run code, and turns every failure into one-line errors.
* `parse_tensor_record` reads a chunk's zip central directory and its tiny `data.pkl` (again with an
  allow-list unpickler that never builds a tensor) to find where the raw storage bytes start inside the
  `.distcp` file. Callers then read exactly the element ranges they need: nothing ever reads a
  whole file or a whole chunk it does not need.

The `.distcp` bytes come through a `ByteSource`: `FdSource` for a local file (`os.pread`/`os.preadv`
on a descriptor, the fast path) or `StoreSource` for an object of any ragckpt `Store` (ranged GETs on
S3). On object stores every small read is a request, so record headers are fetched up front in a few
coalesced ranges (`record_header_ranges`, `coalesce_ranges`) and parsed from memory
(`PrefetchedSource`).
"""

from __future__ import annotations

import bisect
import functools
import io
import os
import pickle
import pickletools
import struct
import warnings
import zipfile
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from ragckpt.errors import FormatError
from ragckpt.format.dtypes import as_bytes
from ragckpt.format.runs import flat_bits, host_bits
from ragckpt.storage.seekable import SeekableReader
from ragckpt.storage.store import Buffer, Store

if TYPE_CHECKING:
    import torch
else:  # importing the DCP converter, as the CLI does, loads no torch (see ragckpt.lazy)
    from ragckpt.lazy import torch

METADATA_FILE = ".metadata"

#: bytes of a record read up front from its start (zip local headers, `data.pkl`: about 700 bytes
#: in torch 2.x) and from its end (the zip central directory: about 600 bytes, 100 more with zip64)
RECORD_HEAD_BYTES = 4 << 10
RECORD_TAIL_BYTES = 4 << 10
#: records up to this size are fetched whole: one request instead of two, and their elements
#: come with them (0-d optimizer steps, norms, biases)
WHOLE_RECORD_BYTES = 16 << 10

# DCP's metadata classes live in these modules; nothing else in torch is needed to rebuild them.
_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "TensorStorageMetadata", "TensorProperties", "StorageMeta",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo", "_StoragePrefix"},
}
_PATH_CLASSES = {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"}


@functools.cache
def _storage_dtypes() -> dict[str, torch.dtype]:
    """The legacy typed-storage class names that torch.save writes for the classic dtypes, built
    once torch is wanted."""
    return {
        "DoubleStorage": torch.float64, "FloatStorage": torch.float32, "HalfStorage": torch.float16,
        "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
        "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8,
        "BoolStorage": torch.bool, "ComplexFloatStorage": torch.complex64, "ComplexDoubleStorage": torch.complex128,
    }


def _torch_dtype_attr(name: str) -> torch.dtype | None:
    obj = getattr(torch, name, None)
    return obj if isinstance(obj, torch.dtype) else None


class _MetadataUnpickler(pickle.Unpickler):
    """Rebuilds DCP `Metadata` and refuses every other global (no code execution from a bad file)."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _DCP_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and (name == "Size" or _torch_dtype_attr(name) is not None):
            return super().find_class(module, name)
        if (module, name) in {("torch.serialization", "_get_layout"), ("collections", "OrderedDict")}:
            return super().find_class(module, name)
        if module == "pathlib" and name in _PATH_CLASSES:
            return super().find_class(module, name)
        if module == "builtins" and name in {"set", "frozenset", "tuple", "list", "dict", "slice"}:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it references {module}.{name}, which DCP metadata never contains")


def load_metadata(directory: str) -> Any:
    """The `Metadata` of the DCP checkpoint in local `directory`, with one-line errors for every bad input."""
    path = os.path.join(directory, METADATA_FILE)
    if not os.path.isdir(directory):
        raise FormatError(f"{directory} is not a directory; a DCP checkpoint is a directory with a {METADATA_FILE} file")
    if not os.path.isfile(path):
        raise FormatError(f"{directory} is not a PyTorch DCP checkpoint: it has no {METADATA_FILE} file")
    with open(path, "rb") as f:
        return parse_metadata(f.read(), path)


#: opcodes that store into the unpickler's memo at the index they carry
_MEMO_PUTS = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})


def _check_opcodes(raw: bytes) -> None:
    """Walk the pickle's opcodes without building anything, raising ValueError for what would make
    the C unpickler allocate what damaged bytes say rather than what the data holds: a length
    beyond the bytes there are (genops checks those), or a memo index beyond any a pickler could
    have written (the memo is grown, zero-filled, to that index: 830 million entries took 12 GB).
    Costs about as much again as the load itself."""
    with warnings.catch_warnings():  # genops's decoding of old STRING opcodes warns on odd escapes
        warnings.simplefilter("ignore")
        for op, arg, pos in pickletools.genops(raw):
            if op.name in _MEMO_PUTS and isinstance(arg, int) and arg > len(raw):
                raise ValueError(f"memo index {arg} at byte {pos} is beyond a {len(raw)}-byte pickle")


def parse_metadata(raw: bytes, path: str) -> Any:
    """Unpickle DCP `Metadata` from the bytes of a `.metadata` file through the allow-list
    unpickler; `path` (a file path or object URL) names it in errors. The opcodes are checked first
    (`_check_opcodes`): random bytes in a `.metadata` were seen to take 24 GB, and the process
    with them."""
    from torch.distributed.checkpoint.metadata import Metadata  # loads torch: only once DCP metadata is read

    try:
        _check_opcodes(raw)
        md = _MetadataUnpickler(io.BytesIO(raw)).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, IndexError, TypeError, ValueError,
            KeyError, struct.error, UnicodeDecodeError, OverflowError, MemoryError, RecursionError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise FormatError(f"{path} is corrupt or truncated ({type(e).__name__}: {msg}); "
                          "re-save the DCP checkpoint") from None
    if not isinstance(md, Metadata):
        raise FormatError(f"{path} does not hold DCP Metadata (found {type(md).__name__})")
    if not isinstance(getattr(md, "state_dict_metadata", None), dict) or not isinstance(md.storage_data, dict):
        raise FormatError(f"{path} is incomplete: it lacks state_dict_metadata or storage_data "
                          "(written by a storage layer other than FileSystemWriter?)")
    return md


# -- where .distcp bytes come from ---------------------------------------------------------------------

class ByteSource(Protocol):
    """Positional reads of one `.distcp` file, wherever it is stored. Both calls behave like pread(2)
    at the end of the data (a short read, never an error), so the parsers below word truncation the
    same way for a local file and an object."""

    def pread(self, n: int, offset: int) -> bytes:
        """Up to `n` bytes at `offset` (header pieces: small reads, returned as a new object)."""
        ...

    def readinto(self, buf: memoryview, offset: int) -> int:
        """Fill `buf` from `offset` with no intermediate copy where the backend allows (tensor
        elements); returns the bytes read."""
        ...


class FdSource:
    """A local file through an open descriptor: exactly the `os.pread` / `os.preadv` calls the local
    import has always made (page-cache reads, no copy for elements)."""

    __slots__ = ("fd",)

    def __init__(self, fd: int):
        self.fd = fd

    def pread(self, n: int, offset: int) -> bytes:
        return os.pread(self.fd, n, offset)

    def readinto(self, buf: memoryview, offset: int) -> int:
        return os.preadv(self.fd, [buf], offset)


class StoreSource:
    """One object of a ragckpt `Store` (S3, any fsspec protocol) of known `size` (from one listing of
    the checkpoint, not a HEAD per object). Reads go through the store, so its retries, request
    deadlines, concurrency bound and one-line errors naming the object apply; reads past `size` are
    cut short like a file's, never requested."""

    __slots__ = ("key", "size", "store")

    def __init__(self, store: Store, key: str, size: int):
        self.store, self.key, self.size = store, key, size

    def pread(self, n: int, offset: int) -> bytes:
        stop = min(offset + n, self.size)
        if stop <= offset:
            return b""
        return bytes(self.store.read_range(self.key, offset, stop))

    def readinto(self, buf: memoryview, offset: int) -> int:
        mv = memoryview(buf).cast("B")
        n = max(0, min(len(mv), self.size - offset))
        if n:
            self.store.read_range_into(self.key, offset, mv[:n])
        return n


class PrefetchedSource:
    """`base` with some of its byte ranges already in memory: reads that fall inside one of them are
    served from it, any other read goes to `base`. Lets `zipfile` parse a record header on an object
    store without a request per seek-and-read."""

    __slots__ = ("_base", "_data", "_starts")

    def __init__(self, base: ByteSource, pieces: Sequence[tuple[int, Buffer]]):
        ordered = sorted(pieces, key=lambda p: p[0])
        self._base = base
        self._starts = [a for a, _ in ordered]
        self._data = [memoryview(d).cast("B") for _, d in ordered]

    def _find(self, offset: int, n: int) -> memoryview | None:
        i = bisect.bisect_right(self._starts, offset) - 1
        if i >= 0:
            rel = offset - self._starts[i]
            if rel + n <= len(self._data[i]):
                return self._data[i][rel : rel + n]
        return None

    def pread(self, n: int, offset: int) -> bytes:
        hit = self._find(offset, n)
        return bytes(hit) if hit is not None else self._base.pread(n, offset)

    def readinto(self, buf: memoryview, offset: int) -> int:
        mv = memoryview(buf).cast("B")
        hit = self._find(offset, len(mv))
        if hit is None:
            return self._base.readinto(mv, offset)
        mv[:] = hit
        return len(mv)


def record_header_ranges(start: int, length: int) -> list[tuple[int, int]]:
    """The byte ranges `parse_tensor_record` reads of the record at `[start, start + length)`: its
    head (local headers and `data.pkl`) and its tail (the central directory, which follows the tensor
    bytes); a small record whole."""
    if length <= WHOLE_RECORD_BYTES:
        return [(start, start + length)]
    return [(start, start + RECORD_HEAD_BYTES), (start + length - RECORD_TAIL_BYTES, start + length)]


def coalesce_ranges(ranges: Sequence[tuple[int, int]], *, gap: int, max_bytes: int) -> list[tuple[int, int]]:
    """Merge byte ranges of one object that overlap or lie within `gap` bytes of each other into
    requests of at most `max_bytes` (a range larger than that stays whole). Adjacent records' head
    and tail windows touch, so a file of many records costs about one request per record, and a
    file of small records a few requests in all."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1] + gap and max(b, out[-1][1]) - out[-1][0] <= max_bytes:
            out[-1] = (out[-1][0], max(b, out[-1][1]))
        else:
            out.append((a, b))
    return out


# -- tensor records inside .distcp files ---------------------------------------------------------------

class FileWindow(SeekableReader):
    """A read-only, seekable view of bytes `[start, start + length)` of a `ByteSource`, so `zipfile`
    can parse one embedded `torch.save` archive without reading the rest of the file."""

    def __init__(self, src: ByteSource, start: int, length: int):
        super().__init__(length)
        self._src, self._start = src, start

    def readinto(self, b: Any) -> int:
        n = max(0, min(len(b), self._size - self._pos))
        if n == 0:
            return 0
        data = self._src.pread(n, self._start + self._pos)
        b[: len(data)] = data
        self._pos += len(data)
        return len(data)


@dataclass(frozen=True)
class _StorageRef:
    key: str
    dtype: torch.dtype | None  # None: an UntypedStorage, the dtype comes with _rebuild_tensor_v3
    numel: int


@dataclass(frozen=True)
class _TensorRef:
    storage: _StorageRef
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


def _rebuild_v2(storage: _StorageRef, storage_offset: int, size: Any, stride: Any, *_: Any) -> _TensorRef:
    if storage.dtype is None:
        raise pickle.UnpicklingError("an untyped storage without a dtype")
    return _TensorRef(storage, int(storage_offset), tuple(int(s) for s in size), tuple(int(s) for s in stride),
                      storage.dtype)


def _rebuild_v3(storage: _StorageRef, storage_offset: int, size: Any, stride: Any, requires_grad: Any,
                hooks: Any, dtype: torch.dtype, *_: Any) -> _TensorRef:
    if not isinstance(dtype, torch.dtype):
        raise pickle.UnpicklingError("a tensor without a dtype")
    return _TensorRef(storage, int(storage_offset), tuple(int(s) for s in size), tuple(int(s) for s in stride), dtype)


class _StorageTag:
    def __init__(self, dtype: torch.dtype | None):
        self.dtype = dtype


class _RecordUnpickler(pickle.Unpickler):
    """Reads `data.pkl` of a `torch.save`d tensor into a `_TensorRef` (where its bytes are), never
    into a tensor, and accepts nothing but the globals a plain tensor save uses."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild_v2
        if module == "torch._utils" and name == "_rebuild_tensor_v3":
            return _rebuild_v3
        if module == "torch" and name in _storage_dtypes():
            return _StorageTag(_storage_dtypes()[name])
        if module == "torch.storage" and name == "UntypedStorage":
            return _StorageTag(None)
        if module == "torch" and _torch_dtype_attr(name) is not None:
            return _torch_dtype_attr(name)
        if module == "collections" and name == "OrderedDict":
            return OrderedDict
        raise pickle.UnpicklingError(f"it references {module}.{name}, which is not part of a plain tensor")

    def persistent_load(self, pid: Any) -> _StorageRef:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _StorageTag)):
            raise pickle.UnpicklingError(f"unexpected persistent id {pid!r:.80}")
        return _StorageRef(str(pid[2]), pid[1].dtype, int(pid[4]))


@dataclass(frozen=True)
class TensorRecord:
    """Where one DCP tensor chunk's elements lie in its `.distcp` file."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    data_offset: int  # absolute file offset of element 0 (storage_offset applied)
    contiguous: bool  # row-major dense: element i is at data_offset + i * itemsize
    stride: tuple[int, ...]
    storage_start: int  # absolute file offset of the storage (for the strided fallback)
    storage_nbytes: int


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, acc = [], 1
    for s in reversed(shape):
        out.append(acc)
        acc *= max(1, s)
    return tuple(reversed(out))


def parse_tensor_record(src: ByteSource, start: int, length: int, where: str) -> TensorRecord:
    """Locate the raw element bytes of the `torch.save` archive at `[start, start + length)` of `src`."""
    head = src.pread(4, start)
    if head != b"PK\x03\x04":
        raise FormatError(f"{where} is not a torch.save record (written with a non-default serialisation, "
                          "e.g. safetensors or a stream transform, which import-dcp does not read)")
    try:
        with zipfile.ZipFile(FileWindow(src, start, length)) as z:
            infos = {i.filename: i for i in z.infolist()}
            pkl = [n for n in infos if n.endswith("/data.pkl") and n.count("/") == 1]
            if len(pkl) != 1:
                raise FormatError(f"{where}: the torch.save record has no data.pkl")
            prefix = pkl[0][: -len("data.pkl")]
            raw_pkl = z.read(pkl[0])
            _check_opcodes(raw_pkl)
            ref = _RecordUnpickler(io.BytesIO(raw_pkl)).load()
            if not isinstance(ref, _TensorRef):
                raise FormatError(f"{where}: the torch.save record holds a {type(ref).__name__}, not a tensor")
            info = infos.get(f"{prefix}data/{ref.storage.key}")
            if info is None:
                raise FormatError(f"{where}: the torch.save record lacks storage data/{ref.storage.key}")
            if info.compress_type != zipfile.ZIP_STORED:
                raise FormatError(f"{where}: the tensor bytes are compressed; DCP never writes that")
            local = src.pread(30, start + info.header_offset)
            if len(local) < 30 or local[:4] != b"PK\x03\x04":
                raise FormatError(f"{where}: broken zip local header for the tensor bytes")
            name_len, extra_len = struct.unpack("<HH", local[26:30])
            storage_start = start + info.header_offset + 30 + name_len + extra_len
            storage_nbytes = info.file_size
    except (zipfile.BadZipFile, pickle.UnpicklingError, EOFError, struct.error, ValueError, TypeError,
            IndexError, OSError, KeyError, AttributeError, OverflowError, MemoryError, RecursionError) as e:
        raise FormatError(f"{where} is corrupt or truncated ({type(e).__name__}: {e})") from None
    itemsize = torch.empty(0, dtype=ref.dtype).element_size()
    shape, stride = ref.size, ref.stride
    numel = 1
    for s in shape:
        numel *= s
    if storage_start + storage_nbytes > start + length:
        raise FormatError(f"{where}: tensor bytes run past the end of the record; the file is corrupt")
    if numel:
        last = ref.storage_offset + sum((s - 1) * st for s, st in zip(shape, stride, strict=True))
        if ref.storage_offset < 0 or (last + 1) * itemsize > storage_nbytes or any(st < 0 for st in stride):
            raise FormatError(f"{where}: the tensor ({shape}, stride {stride}) does not fit its "
                              f"{storage_nbytes}-byte storage; the record is corrupt")
    contiguous = all(st == cs for s, st, cs in zip(shape, stride, _contiguous_strides(shape), strict=True) if s > 1)
    return TensorRecord(ref.dtype, shape, storage_start + ref.storage_offset * itemsize, contiguous, stride,
                        storage_start, storage_nbytes)


def read_record_elements_into(src: ByteSource, rec: TensorRecord, lo: int, out: torch.Tensor, where: str) -> bool:
    """Row-major elements `[lo, lo + out.numel())` of a dense chunk read straight into `out` (1-D,
    contiguous, the record's dtype): no staging buffer, no copy. False, with nothing read, for a
    chunk saved with a permuted memory format, which `read_record_elements` rebuilds."""
    if not rec.contiguous:
        return False
    dst = as_bytes(out)
    start, got = rec.data_offset + lo * out.element_size(), 0
    while got < len(dst):  # one read, unless the kernel cuts it short (2 GiB per call on Linux)
        n = src.readinto(dst[got:], start + got)
        if n <= 0:
            raise FormatError(f"{where} is truncated: needed {len(dst)} bytes, the file ended after {got}")
        got += n
    return True


def read_record_elements(src: ByteSource, rec: TensorRecord, lo: int, hi: int, where: str) -> torch.Tensor:
    """Row-major elements `[lo, hi)` of a chunk as a 1-D tensor: one read when the record is dense,
    otherwise (a chunk saved with a permuted memory format) the strided storage is rebuilt."""
    itemsize = torch.empty(0, dtype=rec.dtype).element_size()
    if hi <= lo:
        return torch.empty(0, dtype=rec.dtype, device="cpu")
    if rec.contiguous:
        want = (hi - lo) * itemsize
        data = bytearray(want)
        got = src.readinto(memoryview(data), rec.data_offset + lo * itemsize)
        if got != want:
            raise FormatError(f"{where} is truncated: needed {want} bytes, the file ended after {got}")
        return torch.frombuffer(data, dtype=torch.uint8).view(rec.dtype)
    data = bytearray(rec.storage_nbytes)
    got = src.readinto(memoryview(data), rec.storage_start)
    if got != rec.storage_nbytes:
        raise FormatError(f"{where} is truncated: needed {rec.storage_nbytes} bytes, the file ended after {got}")
    storage = torch.frombuffer(data, dtype=torch.uint8).view(rec.dtype) if data else torch.empty(0, dtype=rec.dtype, device="cpu")
    off = (rec.data_offset - rec.storage_start) // itemsize
    full = flat_bits(torch.as_strided(storage, rec.shape, rec.stride, off))
    return host_bits(full[lo:hi], copy=True)

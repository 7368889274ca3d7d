"""Logical dtypes and how they are stored.

zarr-python 3.1 has no bfloat16 or float8 data types, so those tensors are stored as raw unsigned
integers of the same width and the logical dtype is recorded in metadata. complex64/complex128 and
uint16/32/64 are zarr v3 core data types and are stored as themselves (a complex array's fill value
is the pair `[0.0, 0.0]`). Every dtype therefore round-trips bit-exactly (NaN payloads, infinities
and negative zero, of both parts of a complex number, included) because bytes are never converted,
only reinterpreted.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import numpy as np

from ragckpt.errors import FormatError

if TYPE_CHECKING:
    import torch
else:
    from ragckpt.lazy import torch

# logical name -> zarr/numpy storage dtype name; torch's dtype of the same name is the logical one
_STORAGE: dict[str, str] = {
    "float64": "float64",
    "float32": "float32",
    "float16": "float16",
    "complex128": "complex128",
    "complex64": "complex64",
    "bfloat16": "uint16",
    "float8_e4m3fn": "uint8",
    "float8_e5m2": "uint8",
    "int64": "int64",
    "int32": "int32",
    "int16": "int16",
    "int8": "int8",
    "uint64": "uint64",
    "uint32": "uint32",
    "uint16": "uint16",
    "uint8": "uint8",
    "bool": "bool",
}

# safetensors dtype code <-> logical dtype name: a rank's extras are stored as one safetensors object,
# and Hugging Face exports are safetensors too. safetensors has no 128-bit complex type (its dtype
# list stops at C64), so complex128 tensors can be neither extras nor exported.
ST_TO_DTYPE: dict[str, str] = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "C64": "complex64",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U64": "uint64",
    "U32": "uint32",
    "U16": "uint16",
    "U8": "uint8",
    "BOOL": "bool",
}
DTYPE_TO_ST: dict[str, str] = {v: k for k, v in ST_TO_DTYPE.items()}

SUPPORTED_DTYPES: tuple[str, ...] = tuple(_STORAGE)


@functools.cache
def _torch_tables() -> tuple[dict[str, torch.dtype], dict[torch.dtype, str]]:
    """(name -> torch dtype, torch dtype -> name), built once torch is wanted (see ragckpt.lazy)."""
    by_name = {name: getattr(torch, name) for name in _STORAGE}
    return by_name, {t: name for name, t in by_name.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """Logical name of a torch dtype, as written in checkpoint metadata."""
    try:
        return _torch_tables()[1][dtype]
    except KeyError:
        raise FormatError(f"dtype {dtype} is not supported; supported: {', '.join(SUPPORTED_DTYPES)}") from None


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _torch_tables()[0][name]
    except KeyError:
        raise FormatError(
            f"unknown dtype '{name}'; supported: {', '.join(SUPPORTED_DTYPES)}"
        ) from None


def storage_dtype(name: str) -> np.dtype:
    """numpy dtype of the stored bytes (what plain zarr reports for the array)."""
    try:
        return np.dtype(_STORAGE[name])
    except KeyError:
        raise FormatError(f"unknown dtype '{name}'; supported: {', '.join(SUPPORTED_DTYPES)}") from None


def itemsize(name: str) -> int:
    return storage_dtype(name).itemsize


def as_bytes(t: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor."""
    if not t.is_contiguous():
        raise ValueError("tensor must be contiguous to be viewed as bytes")
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    if flat.numel() == 1 and flat.stride(0) != 1:
        flat = flat.as_strided((1,), (1,))  # one element counts as contiguous whatever its stride
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def from_bytes(buf: bytes | bytearray | memoryview, name: str) -> torch.Tensor:
    """Reinterpret bytes as a 1-D tensor of logical dtype `name` (shares memory when writable)."""
    dt = torch_dtype(name)
    if len(buf) == 0:
        return torch.empty(0, dtype=dt, device="cpu")
    arr = np.frombuffer(buf, dtype=np.uint8)
    # torch assumes elements at addresses aligned to their size: a complex128 piece that starts 8
    # bytes into a block (block_bytes=1000) crashed the process in the copy that followed
    if not arr.flags.writeable or arr.ctypes.data % dt.itemsize:
        arr = arr.copy()
    return torch.from_numpy(arr).view(dt)

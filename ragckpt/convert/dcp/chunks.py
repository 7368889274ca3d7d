"""The saved chunks (boxes) of a DCP tensor and the geometry of reading them: validating that
they tile the tensor exactly, and the contiguous runs a box covers in the tensor's and a chunk's
flat space. Pure numpy, separate from the file access in `reader`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ragckpt.checkpoint.manifest import brief
from ragckpt.errors import FormatError
from ragckpt.planner.state import MAX_NUMEL


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



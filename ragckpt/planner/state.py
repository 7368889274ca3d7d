"""`CheckpointLayout`: every buffer of a sharded state and the layout each one follows.

A training engine keeps one flat buffer per (role, dtype): parameters, Adam moments, master weights.
Buffers that share a layout (parameters and their optimizer states) point to the same `BufferLayout`,
so its tables are stored once. Each buffer maps the layout's slots to tensor names.

It sits in the planner layer, above the format's tables, because `build` and `with_tensors` plan
ragged layouts with `ragckpt.planner.planner`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ragckpt.errors import LayoutError, OutOfRangeError, UnknownNameError
from ragckpt.format.dtypes import dtype_name, itemsize
from ragckpt.format.layout import BufferLayout, element_layout, row_layout
from ragckpt.format.names import is_text
from ragckpt.format.placement import MAX_NUMEL, counts, numel_of, world_size_of
from ragckpt.planner.planner import GranularitySpec, plan_layout

if TYPE_CHECKING:
    import torch

#: the kinds a layout can be built as for any world size; "custom" layouts are given, never built
PLANNED_KINDS = ("ragged", "row", "element")
LAYOUT_KINDS = (*PLANNED_KINDS, "custom")

#: padding an alignment may add beyond the data's own size before it is refused (a typo such as
#: `align=2**40` would otherwise have a writer allocate and write terabytes of zeros)
MAX_ALIGN_PADDING_BYTES = 1 << 30


@dataclass(frozen=True)
class BufferSpec:
    """One flat buffer per rank: its dtype, the layout it follows and the tensor in every slot."""

    name: str
    dtype: str  # logical dtype name, see ragckpt.format.dtypes
    layout: int  # index into CheckpointLayout.layouts
    tensors: tuple[str, ...]


@dataclass
class CheckpointLayout:
    world_size: int
    kind: str
    layouts: list[BufferLayout]
    buffers: list[BufferSpec]
    _index: dict[str, tuple[int, int]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.world_size = world_size_of(self.world_size)  # a plain int: it goes into the JSON
        if self.kind not in LAYOUT_KINDS:
            raise LayoutError(f"layout kind '{self.kind}' is unknown; use one of {', '.join(LAYOUT_KINDS)}")
        names = [b.name for b in self.buffers]
        for b in self.buffers:
            check_name(b.name, "buffer")
            for t in b.tensors:
                check_name(t, "tensor")
        if len(set(names)) != len(names):
            raise LayoutError(f"buffer names must be unique, got {names}")
        for lay in self.layouts:
            if lay.world_size != self.world_size:
                raise LayoutError(f"a layout has world size {lay.world_size}, the checkpoint {self.world_size}")
        self._index = {}
        for bi, b in enumerate(self.buffers):
            if not 0 <= b.layout < len(self.layouts):
                raise LayoutError(f"buffer '{b.name}' refers to layout #{b.layout}, which does not exist")
            lay = self.layouts[b.layout]
            if len(b.tensors) != len(lay.shapes):
                raise LayoutError(f"buffer '{b.name}' names {len(b.tensors)} tensors, its layout has {len(lay.shapes)}")
            itemsize(b.dtype)  # validates the dtype name
            for si, t in enumerate(b.tensors):
                if t in self._index:
                    raise LayoutError(f"tensor '{t}' appears twice in the checkpoint layout")
                self._index[t] = (bi, si)

    # -- lookups ------------------------------------------------------------------------------------
    def names(self) -> list[str]:
        """Every tensor of every buffer, in buffer then slot order."""
        return list(self._index)

    def locate(self, name: str) -> tuple[int, int]:
        """(buffer index, slot) of tensor `name`: the slot indexes the buffer layout's tables
        (`layout_of(b).shapes[slot]`, `placement(slot)`, the `slot` column of its segments)."""
        try:
            return self._index[name]
        except KeyError:
            raise UnknownNameError(f"tensor '{name}' is not in this checkpoint or layout") from None

    def buffer_index(self, name: str) -> int:
        """Index of the buffer called `name` (`build` names buffers by dtype: "bfloat16", ...)."""
        for i, b in enumerate(self.buffers):
            if b.name == name:
                return i
        raise UnknownNameError(f"buffer '{name}' is not in this checkpoint or layout; buffers: "
                               f"{[b.name for b in self.buffers]}")

    def layout_of(self, buffer: int | str) -> BufferLayout:
        """The BufferLayout buffer `buffer` (its index or name) follows (shared by buffers made with
        `with_buffer`): `rank_segments(rank)` says which piece of which tensor sits where in that
        rank's buffer."""
        return self.layouts[self.buffers[self.buffer_at(buffer)].layout]

    def buffer_at(self, buffer: object) -> int:
        """The index of buffer `buffer`, given by name (as `read_rank` takes it) or by index: a name
        reached list indexing as a raw TypeError, and a negative index counted from the end."""
        if type(buffer) is int and 0 <= buffer < len(self.buffers):  # the common case, checked first
            return buffer
        if isinstance(buffer, str):
            return self.buffer_index(buffer)
        if isinstance(buffer, (int, np.integer)) and not isinstance(buffer, bool) and 0 <= buffer < len(self.buffers):
            return int(buffer)
        raise OutOfRangeError(f"buffer {buffer!r} is neither the name nor the index (0..{len(self.buffers) - 1}) "
                              f"of one of the buffers {[b.name for b in self.buffers]}")

    def shape(self, name: str) -> tuple[int, ...]:
        """Global shape of tensor `name`."""
        b, s = self.locate(name)
        return self.layout_of(b).shapes[s]

    def rank_sizes(self, buffer: int | str) -> np.ndarray:
        """(W,) elements of every rank's flat buffer `buffer` (its index or name), padding included:
        what to allocate."""
        return self.layout_of(buffer).rank_sizes()

    def total_bytes(self) -> int:
        """Bytes of all ranks' buffers together, padding included (what a save writes)."""
        return int(sum(self.layout_of(i).total_elements() * itemsize(b.dtype) for i, b in enumerate(self.buffers)))

    def data_bytes(self) -> int:
        """Bytes of the tensors themselves, padding excluded."""
        return int(sum(int(self.layout_of(i).numels.sum()) * itemsize(b.dtype) for i, b in enumerate(self.buffers)))

    # -- construction --------------------------------------------------------------------------------
    @classmethod
    def build(
        cls,
        tensors: Mapping[str, tuple[Sequence[int], str]],
        world_size: int,
        kind: str = "ragged",
        granularity: GranularitySpec = "row",
        align: int = 1,
    ) -> CheckpointLayout:
        """Lay out named tensors `{name: (shape, dtype_name)}` for `world_size` ranks: one buffer per
        dtype (an engine flattens per dtype too), each with its own layout of `kind`."""
        world_size = world_size_of(world_size)
        check_plan_options(kind, granularity, align, tensors)
        groups: dict[str, list[str]] = {}
        for name, (_, dt) in tensors.items():
            groups.setdefault(dt if isinstance(dt, str) else dtype_name(dt), []).append(name)
        layouts: list[BufferLayout] = []
        buffers: list[BufferSpec] = []
        for dt, names in groups.items():
            layouts.append(plan_buffer(kind, names, [tensors[n][0] for n in names], world_size, granularity, align))
            buffers.append(BufferSpec(name=dt, dtype=dt, layout=len(layouts) - 1, tensors=tuple(names)))
        return check_align_padding(cls(world_size, kind, layouts, buffers), align)

    def with_tensors(self, name: str, tensors: Mapping[str, tuple[Sequence[int], str]], *,
                     granularity: GranularitySpec = "row", align: int = 1) -> CheckpointLayout:
        """A layout with one more buffer `name` holding `tensors` (`{name: (shape, dtype)}`, one
        dtype), laid out on their own by this layout's kind: state that does not follow the
        parameters element for element, e.g. each parameter's 0-d Adam `step`
        (`granularity="whole"` gives each a single owner; ragged layouts only: row and element
        layouts place a 0-d tensor on one rank anyway)."""
        dts = {dt if isinstance(dt, str) else dtype_name(dt) for _, dt in tensors.values()}
        if len(dts) != 1:
            raise LayoutError(f"buffer '{name}' needs tensors of one dtype, got {sorted(dts) or 'none'}")
        check_plan_options(self.kind, granularity, align, tensors)
        names = list(tensors)
        lay = plan_buffer(self.kind, names, [tensors[n][0] for n in names], self.world_size, granularity, align)
        spec = BufferSpec(name=name, dtype=dts.pop(), layout=len(self.layouts), tensors=tuple(names))
        return check_align_padding(
            CheckpointLayout(self.world_size, self.kind, [*self.layouts, lay], [*self.buffers, spec]), align)

    def with_buffer(self, name: str, dtype: str | torch.dtype, like: str, tensors: Sequence[str]) -> CheckpointLayout:
        """A layout with one more buffer that shares buffer `like`'s layout (e.g. Adam moments that
        follow the parameters). `dtype` is a name (`"float32"`) or a torch dtype, as in `build`."""
        src = self.buffers[self.buffer_index(like)]
        if isinstance(tensors, str):
            raise LayoutError(f"buffer '{name}': tensors must be a sequence of tensor names, not the str {tensors!r}")
        spec = BufferSpec(name=name, dtype=dtype if isinstance(dtype, str) else dtype_name(dtype), layout=src.layout,
                          tensors=tuple(tensors))
        return CheckpointLayout(self.world_size, self.kind, list(self.layouts), [*self.buffers, spec])


def check_name(name: object, what: str) -> None:
    """A tensor or buffer name the metadata can record: a str of valid Unicode text. Checked where a
    layout is made, since a save would otherwise write every rank's data and fail at its commit."""
    if not isinstance(name, str):
        raise LayoutError(f"{what} name {name!r} is not a str but a {type(name).__name__}; name every {what} "
                          "with a str")
    if not is_text(name):
        raise LayoutError(f"{what} name {ascii(name)} is not valid Unicode text (a lone surrogate); rename the "
                          f"{what}")


def check_plan_options(kind: str, granularity: GranularitySpec, align: object,
                       tensors: Mapping[str, object]) -> None:
    """Refuse what a layout of `kind` would silently ignore: a granularity or an alignment it has no
    use for, a per-name granularity for a name that is not there (a typo would leave that tensor on
    the default), and names that are not strings (the metadata could not record them, and a save
    would fail only at its commit)."""
    if kind not in PLANNED_KINDS:
        raise _unplanned(kind)
    for name in tensors:
        check_name(name, "tensor")
    if kind != "ragged" and not (isinstance(granularity, str) and granularity == "row"):
        raise LayoutError(f"granularity applies to ragged layouts only, and this layout is '{kind}' "
                          f"(which places every tensor by rows or elements); drop granularity={granularity!r}")
    if isinstance(granularity, Mapping):
        unknown = [k for k in granularity if k != "*" and k not in tensors]
        if unknown:
            raise UnknownNameError(f"granularity names {len(unknown)} tensor(s) not in the layout: "
                                   f"{', '.join(map(repr, unknown[:5]))}{' ...' if len(unknown) > 5 else ''}; "
                                   "check the names (\"*\" sets the default)")
    if isinstance(align, bool) or not isinstance(align, (int, np.integer)) or align < 1:
        raise LayoutError(f"align must be a positive integer, got {align!r}")
    if align > 1 and kind not in ("ragged", "element"):
        raise LayoutError(f"align applies to flat layouts (ragged, element) only, and this layout is '{kind}'; "
                          "drop align")


def check_align_range(align: int, world_size: int) -> None:
    """Every rank's share is at least `align` elements: past this the layout's sizes would wrap
    int64 (of bytes, for 16-byte elements) before `check_align_padding` could weigh them."""
    if align > 1 and align * world_size >= MAX_NUMEL // 16:
        raise LayoutError(f"align {align} at {world_size} ranks would pad the layout with at least "
                          f"{align * world_size:,} elements; choose a smaller alignment")


def check_align_padding(layout: CheckpointLayout, align: int, *, option: str = "align",
                        what: str = "the layout") -> CheckpointLayout:
    """Refuse an alignment that pads `layout` past `MAX_ALIGN_PADDING_BYTES` and its own data;
    `option` and `what` word the error for the caller (`--align`, "the destination")."""
    data, pad = layout.data_bytes(), layout.total_bytes() - layout.data_bytes()
    if align > 1 and pad > max(data, MAX_ALIGN_PADDING_BYTES):
        raise LayoutError(f"{option} {align} would pad {what} with {pad:,} bytes for {data:,} bytes of tensor "
                          "data; choose a smaller alignment")
    return layout


def plan_buffer(kind: str, names: Sequence[str], shapes: Sequence[Sequence[int]], world_size: int,
          granularity: GranularitySpec, align: int) -> BufferLayout:
    """One buffer's layout of `kind` (ragged, row, element) for tensors of `shapes`; `granularity`
    and `align` as the planner and element layouts take them."""
    check_align_range(align, world_size)
    dims = [counts(s, f"the shape of tensor '{n}'") for n, s in zip(names, shapes, strict=True)]
    for n, d in zip(names, dims, strict=True):
        if any(x >= MAX_NUMEL for x in d):  # even with no elements: readers refuse such shapes
            raise LayoutError(f"tensor '{n}' of shape {d} has a dimension beyond what a layout can address "
                              "(under 2**62); check the shape")
        if numel_of(d) >= MAX_NUMEL:
            raise LayoutError(f"tensor '{n}' of shape {d} has {numel_of(d):,} elements, more than a layout can "
                              f"address (under 2**62); check the shape")
    total = sum(numel_of(d) for d in dims)
    if total >= MAX_NUMEL:
        raise LayoutError(f"the {len(names)} tensors of one buffer ('{names[0]}', ...) total {total:,} elements, "
                          "more than a buffer can address (under 2**62); check the shapes")
    if kind == "ragged":
        return plan_layout(list(names), dims, world_size, granularity, align)
    if kind == "row":
        return row_layout(dims, world_size)
    if kind == "element":
        return element_layout(dims, world_size, align)
    raise _unplanned(kind)


def _unplanned(kind: str) -> LayoutError:
    return LayoutError(f"cannot build a '{kind}' layout automatically; use ragged, row or element")

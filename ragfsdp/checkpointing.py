"""`state` / `load_state`: a sharded model (and optimizer) as a ragckpt checkpoint, and back.

Saving writes each group's `shard` as is (the checkpoint layout is the groups' own FlatLayouts);
loading goes through ragckpt's load-time resharder, so any world size and layout loads, including an
`ragckpt import-hf` checkpoint. ragckpt's load never casts, so a tensor stored in another dtype
(bf16 weights of an HF import) is read into a temporary of one group's shard in the stored dtype
and cast into the master shard: memory bounded by the largest group's shard.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import ragckpt
from ragfsdp.engine.api import flat_groups


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _layout(model: nn.Module, optimizer: Any | None) -> tuple[ragckpt.CheckpointLayout, dict[str, torch.Tensor]]:
    groups = flat_groups(model)
    layouts: list = []
    specs: list[ragckpt.BufferSpec] = []
    buffers: dict[str, torch.Tensor] = {}
    index: dict[str, int] = {}
    for g in groups:
        index[g.buffer_name] = len(layouts)
        layouts.append(g.layout)
        specs.append(ragckpt.BufferSpec(g.buffer_name, _dtype_name(g.dtype), index[g.buffer_name], g.param_names))
        buffers[g.buffer_name] = g.shard
    for sb in (optimizer.checkpoint_buffers() if optimizer is not None else []):
        if sb.like is not None:
            if sb.like not in index:
                raise ValueError(f"optimizer buffer '{sb.name}' follows '{sb.like}', which is not a group of this model")
            li = index[sb.like]
        else:
            li = len(layouts)
            layouts.append(sb.layout)
        specs.append(ragckpt.BufferSpec(sb.name, sb.dtype, li, tuple(sb.tensors)))
        buffers[sb.name] = sb.local
    world = groups[0].world_size
    return ragckpt.CheckpointLayout(world, "ragged", layouts, specs), buffers


def state(model: nn.Module, optimizer: Any | None = None) -> dict:
    """What `ragckpt.save_shard(url, **state)` (or `save_shard_async`) takes for this rank."""
    layout, buffers = _layout(model, optimizer)
    user = dict(optimizer.checkpoint_user()) if optimizer is not None else {}
    return {"rank": flat_groups(model)[0].rank, "buffers": buffers, "layout": layout, "user": user}


def _check_tensors(ck: ragckpt.Checkpoint, layout: ragckpt.CheckpointLayout, bi: int) -> str:
    """The checkpoint's dtype for buffer `bi`'s tensors (one for all), after checking names and shapes."""
    spec = layout.buffers[bi]
    dtypes = set()
    for t in spec.tensors:
        try:
            sb, _ = ck.layout.locate(t)
        except (ragckpt.UnknownNameError, KeyError):
            raise ragckpt.UnknownNameError(f"tensor '{t}' is not in checkpoint {ck.url}") from None
        if ck.layout.shape(t) != layout.shape(t):
            raise ragckpt.LayoutError(f"tensor '{t}': checkpoint shape {ck.layout.shape(t)}, model {layout.shape(t)}")
        dtypes.add(ck.layout.buffers[sb].dtype)
    if len(dtypes) > 1:
        raise ragckpt.LayoutError(f"buffer '{spec.name}': its tensors are stored in several dtypes {sorted(dtypes)}")
    return dtypes.pop() if dtypes else spec.dtype


def load_state(model: nn.Module, optimizer: Any | None, url: str, *,
               storage_options: dict | None = None) -> ragckpt.Checkpoint:
    """Fill the live shards (and the optimizer's buffers) from the checkpoint at `url`, any world size."""
    ck = ragckpt.open(url, storage_options=storage_options)
    layout, buffers = _layout(model, optimizer)
    groups = flat_groups(model)
    for g in groups:
        g.reshard()  # the next forward gathers the loaded values
    rank = groups[0].rank
    n_groups = len(groups)
    stored = [_check_tensors(ck, layout, bi) for bi in range(n_groups)]
    opt_specs = layout.buffers[n_groups:]
    present = [all(t in set(ck.layout.names()) for t in s.tensors) for s in opt_specs]
    if any(present) and not all(present):
        missing = next(s.name for s, p in zip(opt_specs, present, strict=True) if not p)
        raise ragckpt.UnknownNameError(f"checkpoint {ck.url} has optimizer state but not buffer '{missing}'")
    for bi in range(n_groups):
        spec = layout.buffers[bi]
        if stored[bi] == spec.dtype:
            ragckpt.load(ck, layout, rank, {spec.name: buffers[spec.name]})
            continue
        tmp_spec = ragckpt.BufferSpec(spec.name, stored[bi], 0, spec.tensors)
        tmp_layout = ragckpt.CheckpointLayout(layout.world_size, "ragged", [layout.layout_of(bi)], [tmp_spec])
        tmp = ragckpt.load(ck, tmp_layout, rank)[spec.name]
        with torch.no_grad():
            buffers[spec.name].copy_(tmp)
    if optimizer is not None:
        if opt_specs and all(present):
            ragckpt.load(ck, layout, rank, {s.name: buffers[s.name] for s in opt_specs})
            optimizer.after_load(ck)
        else:
            optimizer.after_load(None)
    return ck

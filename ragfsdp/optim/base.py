"""`FlatOptimizer`: what every ragfsdp optimizer shares, on the local shards of `flat_groups(model)`.

Optimizer state lives in flat buffers with the parameters' layout, so a checkpoint holds it beside
the parameters and it reshards with them. The per-parameter bookkeeping that torch keeps (a 0-d
float32 `step` per parameter, hyperparameters per param group) is kept here the same way, so a
checkpoint exported with `ragckpt export-dcp` loads into torch's own optimizer:

- steps are replicated on every rank (every rank steps every group: the reduce-scatter that fills
  `FlatGroup.grad` runs on all of them) and saved as tensors `optim.state.<param>.step` of one buffer
  `optim.step` whose layout gives each step one owner (`plan_layout(..., "whole")`);
- `param_groups` are torch-like dicts (`params` holds parameter FQNs); the checkpoint records every
  hyperparameter per parameter under `user["optim.param_groups"]`, as docs/ENGINE.md describes.

Subclasses implement `_update(group_index, group)` on the groups that have a gradient.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch
from torch import nn

import ragckpt
from ragfsdp.engine import collectives
from ragfsdp.engine.api import flat_groups
from ragfsdp.engine.flat_group import FlatGroup, Piece
from ragfsdp.optim.state_buffer import StateBuffer

STEP_BUFFER = "optim.step"


def torch_hyperparameters(cls: type[torch.optim.Optimizer], **kwargs: Any) -> dict[str, Any]:
    """Every key of `cls`'s param group (except `params`) for these arguments. Taken from a live torch
    optimizer because `dcp.load` into torch asks for every key its groups have (amsgrad, foreach, ...)."""
    return {k: v for k, v in cls([torch.zeros(1, 1)], **kwargs).param_groups[0].items() if k != "params"}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def zeros_like_shard(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed state buffer; page-aligned on CPU so `save_shard` writes it without a copy."""
    if device.type == "cpu":
        return ragckpt.aligned_empty(n, dtype).zero_()
    return torch.zeros(n, dtype=dtype, device=device)


class Run(NamedTuple):
    """Part of one group's shard that one update call handles: one param group's hyperparameters and
    one step count. `pieces` None means the whole shard (padding included: it stays zero under
    elementwise updates whose state starts at zero); otherwise the listed pieces only."""

    hyper: dict[str, Any]
    step: float
    pieces: list[Piece] | None


def _jsonable(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.item()
    return list(v) if isinstance(v, tuple) else v


class FlatOptimizer:
    """Base of the optimizers over `ragfsdp.flat_groups(model)` (see the module docstring).

    `granularity` is what `fully_shard` should be given for this optimizer's update to be possible on
    the local shards (None: the engine's default, whole rows)."""

    granularity: Any = None

    def __init__(self, model: nn.Module, defaults: dict[str, Any]) -> None:
        """One param group with `defaults` over every parameter; subclasses may split it."""
        self.groups: list[FlatGroup] = flat_groups(model)
        self.param_names: list[str] = [n for g in self.groups for n in g.param_names]
        self.param_groups: list[dict[str, Any]] = [dict(defaults, params=list(self.param_names))]
        self._index = {n: i for i, n in enumerate(self.param_names)}
        self._first_slot = []
        i = 0
        for g in self.groups:
            self._first_slot.append(i)
            i += len(g.param_names)
        self._trainable = torch.tensor([p.requires_grad for g in self.groups for p in g.params], dtype=torch.bool)
        self.steps = torch.zeros(len(self.param_names), dtype=torch.float32)  # torch's 0-d float32 steps
        g0 = self.groups[0]
        self._world = g0.world_size
        self._rank = g0.rank
        self._process_group = g0.process_group
        self._device = g0.device
        self.step_layout = ragckpt.plan_layout(self.param_names, [()] * len(self.param_names), self._world, "whole")
        self._step_local = torch.zeros(self.step_layout.shard_size, dtype=torch.float32, device=self._device)
        self._of: dict[str, int] = {}
        self._step_names = tuple(f"optim.state.{n}.step" for n in self.param_names)

    # -- state buffers ----------------------------------------------------------------------------
    def moment_buffer(self, group: FlatGroup, key: str) -> StateBuffer:
        """A zeroed state buffer following `group` element for element, tensors `optim.state.<p>.<key>`."""
        name = f"optim.{key}." + group.buffer_name.removeprefix("params.")
        local = zeros_like_shard(group.shard.numel(), group.dtype, group.device)
        return StateBuffer(name, dtype_name(group.dtype), group.buffer_name, None,
                           tuple(f"optim.state.{n}.{key}" for n in group.param_names), local)

    def subset_buffer(self, group: FlatGroup, names: Iterable[str], key: str) -> tuple[StateBuffer, dict[tuple, int]]:
        """A zeroed state buffer for some of `group`'s parameters only (Muon's momentum for its matrices,
        AdamW moments for the rest), holding on every rank exactly that rank's pieces of them, so it
        costs no memory for the others. Returns it with {(slot, flat_start): offset in `local`} for
        this rank's pieces.

        Each rank's pieces keep their order and their cut points; a piece continued from the previous
        rank goes first and one continued on the next rank last (the gap, if any, before it), so each
        tensor is still contiguous in the global flat buffer: a valid FlatLayout that reshards by name."""
        wanted = set(names)
        slots = [s for s, n in enumerate(group.param_names) if n in wanted]
        seg = group.layout.segments()
        per_rank: list[list[tuple[int, int, int, int]]] = [[] for _ in range(self._world)]
        for s, f, n, r, o in zip(seg.slot, seg.flat_start, seg.length, seg.rank, seg.offset, strict=True):
            if group.param_names[int(s)] in wanted:
                per_rank[int(r)].append((int(o), int(s), int(f), int(n)))
        S = max((sum(p[3] for p in pcs) for pcs in per_rank), default=0)
        where: dict[tuple, tuple[int, int]] = {}  # (slot, flat_start) -> (rank, local offset)
        for r, pcs in enumerate(per_rank):
            pcs.sort()
            pos = 0
            for i, (_, s, f, n) in enumerate(pcs):
                continues = f + n < math.prod(group.shapes[s])
                at = S - n if i == len(pcs) - 1 and continues else pos
                where[(s, f)] = (r, at)
                pos += n
        offsets = [where[(s, 0)][0] * S + where[(s, 0)][1] if (s, 0) in where else 0 for s in slots]
        layout = ragckpt.FlatLayout(self._world, S, tuple(group.shapes[s] for s in slots),
                                    tuple(group.layout.dims[s] for s in slots), tuple(offsets))
        name = f"optim.{key}." + group.buffer_name.removeprefix("params.")
        local = zeros_like_shard(S, group.dtype, group.device)
        sb = StateBuffer(name, dtype_name(group.dtype), None, layout,
                         tuple(f"optim.state.{group.param_names[s]}.{key}" for s in slots), local)
        return sb, {k: o for k, (r, o) in where.items() if r == self._rank}

    def state_buffers(self) -> list[StateBuffer]:
        """The subclass's own state buffers (moments, momentum)."""
        raise NotImplementedError

    def checkpoint_buffers(self) -> list[StateBuffer]:
        """This rank's state buffers as `ragfsdp.state` saves them: the owned steps, then the moments."""
        seg = self.step_layout.rank_segments(self._rank)
        self._step_local.zero_()
        if len(seg):
            self._step_local[torch.as_tensor(seg.offset)] = self.steps[torch.as_tensor(seg.slot)].to(self._device)
        steps = StateBuffer(STEP_BUFFER, "float32", None, self.step_layout, self._step_names, self._step_local)
        return [steps, *self.state_buffers()]

    def checkpoint_user(self) -> dict[str, Any]:
        hyper = {}
        for pg in self.param_groups:
            h = {k: _jsonable(v) for k, v in pg.items() if k != "params"}
            for n in pg["params"]:
                hyper[n] = dict(h)
        return {"optim.param_groups": hyper}

    def after_load(self, ck: ragckpt.Checkpoint | None) -> None:
        """Restore steps (all-gathered from their owners) and hyperparameters after `load_state` filled
        the buffers; with None (no optimizer state in the checkpoint) start fresh."""
        if ck is None:
            self.steps.zero_()
            self.reset_state()
            return
        full = torch.empty(self._world * self.step_layout.shard_size, dtype=torch.float32, device=self._device)
        collectives.all_gather(full, self._step_local, self._process_group)
        self.steps.copy_(full[torch.as_tensor(self.step_layout.offsets)].cpu())
        saved = ck.user.get("optim.param_groups")
        if isinstance(saved, list):  # torch's own form: groups with `params` lists of names
            saved = {n: {k: v for k, v in g.items() if k != "params"} for g in saved for n in g["params"]}
        if isinstance(saved, dict):
            self.param_groups = self._regroup(saved)

    def reset_state(self) -> None:
        """Start the state buffers afresh (zeros); an optimizer that allocates them lazily may drop them."""
        for sb in self.state_buffers():
            sb.local.zero_()

    def _regroup(self, saved: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
        """The current groups, split where the checkpoint gives their parameters different values."""
        out: list[dict[str, Any]] = []
        for pg in self.param_groups:
            parts: dict[str, dict[str, Any]] = {}
            for n in pg["params"]:
                h = {k: v for k, v in pg.items() if k != "params"}
                for k, v in saved.get(n, {}).items():
                    if k in h:
                        h[k] = tuple(v) if isinstance(h[k], tuple) and isinstance(v, list) else v
                key = repr(sorted(h.items()))
                parts.setdefault(key, dict(h, params=[]))["params"].append(n)
            out.extend(parts.values())
        return out

    # -- stepping ---------------------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        for g in self.groups:
            if set_to_none:
                g.grad = None
            elif g.grad is not None:
                g.grad.zero_()

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One update of every group that has a gradient; the steps of its trainable parameters first
        count up by one (as torch's `step_t += 1`, in float32)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._of = self._group_of()  # param_groups may have been edited between steps
        for gi, g in enumerate(self.groups):
            if g.grad is None:
                continue
            a = self._first_slot[gi]
            sl = slice(a, a + len(g.param_names))
            # torch skips a parameter without a gradient; here that is one with requires_grad off now
            self._trainable[sl] = torch.tensor([p.requires_grad for p in g.params], dtype=torch.bool)
            self.steps[sl] += self._trainable[sl].to(torch.float32)
            self._update(gi, g)
        return loss

    def _update(self, gi: int, group: FlatGroup) -> None:
        raise NotImplementedError

    def runs(self, gi: int, group: FlatGroup, names: Iterable[str] | None = None) -> list[Run]:
        """This rank's trainable pieces of `group` (those of `names` only, if given) split by param group
        and step; one whole-shard run when all of the group's parameters share both."""
        a = self._first_slot[gi]
        n = len(group.param_names)
        of = self._of or self._group_of()
        wanted = None if names is None else set(names)
        trainable = self._trainable[a:a + n].tolist()  # one conversion, not one per parameter
        steps = self.steps[a:a + n].tolist()
        if wanted is None and all(trainable):
            keys = {(of[name], st) for name, st in zip(group.param_names, steps, strict=True)}
            if len(keys) == 1:
                pgi, step = keys.pop()
                return [Run(self.param_groups[pgi], step, None)]
        parts: dict[tuple[int, float], list[Piece]] = {}
        for pc in group.pieces():
            if not trainable[pc.slot] or (wanted is not None and pc.name not in wanted):
                continue
            parts.setdefault((of[pc.name], steps[pc.slot]), []).append(pc)
        return [Run(self.param_groups[pgi], step, pcs) for (pgi, step), pcs in parts.items()]

    def _group_of(self) -> dict[str, int]:
        return {n: i for i, pg in enumerate(self.param_groups) for n in pg["params"]}

    def step_of(self, name: str) -> float:
        return float(self.steps[self._index[name]])

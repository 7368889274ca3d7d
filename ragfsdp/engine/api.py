"""`fully_shard` and the functions that act on a sharded model as a whole."""

from __future__ import annotations

import contextlib
import fnmatch
from collections.abc import Callable, Iterator, Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

import ragckpt
from ragfsdp.engine import owner_balance
from ragfsdp.engine.flat_group import FlatGroup
from ragfsdp.engine.mixed_precision import MixedPrecisionPolicy
from ragfsdp.engine.unit import Unit, make_root, unit_of

Policy = str | int
# every parameter some unit owns -> that unit's module class name, so that a second, non-enclosing
# unit claiming it (two sibling modules sharing a weight) is refused when it is created
_owner: WeakIdKeyDictionary = WeakIdKeyDictionary()
Granularity = Policy | Mapping[str, Policy] | Callable[[str, tuple], Policy] | None


def _policy(granularity: Granularity) -> Policy | Callable[[str, tuple], Policy]:
    """ragckpt's planner matches mapping keys exactly; here keys are fnmatch patterns, first match wins."""
    if granularity is None:
        return "row"
    if isinstance(granularity, Mapping):
        items = list(granularity.items())

        def pick(name: str, shape: tuple) -> Policy:
            for pat, pol in items:
                if fnmatch.fnmatchcase(name, pat):
                    return pol
            return "row"
        return pick
    return granularity


def plan_unit(names: list[str], shapes: list[tuple[int, ...]], world: int,
              granularity: Granularity | Policy | Callable[[str, tuple], Policy]) -> ragckpt.FlatLayout:
    """The layout `fully_shard` gives one unit's parameters of one dtype: the planner's, rotated so
    that whole-owned tensors of successive units land on other ranks (see owner_balance). A tool
    that checks a model's plan before starting a job (ragfsdp.train) plans with this, between
    `owner_balance.reset()` calls."""
    return owner_balance.balance(ragckpt.plan_layout(names, shapes, world, _policy(granularity)))


def fully_shard(module: nn.Module, *, group: dist.ProcessGroup | None = None, granularity: Granularity = None,
                mp_policy: MixedPrecisionPolicy | None = None, reshard_after_forward: bool = True) -> nn.Module:
    """Shard the parameters of `module` not already owned by a nested unit, in place (names and
    parameter objects unchanged), one flat buffer per dtype; returns `module`."""
    if unit_of(module) is not None:
        raise ValueError(f"{type(module).__name__} is already sharded by ragfsdp.fully_shard; shard each module once")
    nested = [(n, u) for n, m in module.named_modules() if n and (u := unit_of(m)) is not None]
    owned: dict[int, str] = {}
    for n, u in nested:
        for pid in u.param_ids:
            owned.setdefault(pid, n)
    mine: dict[torch.dtype, list[tuple[str, nn.Parameter]]] = {}
    seen: set[int] = set()
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in owned:
            if not name.startswith(owned[id(p)] + "."):
                raise ValueError(f"parameter '{name}' is shared with the sharded module '{owned[id(p)]}'; "
                                 "shard the module that holds both uses")
            continue
        if id(p) in seen:
            continue
        if p in _owner:
            raise ValueError(f"parameter '{name}' is already sharded by another ragfsdp.fully_shard unit "
                             f"({_owner[p]}); a parameter shared between two units is refused: shard a module "
                             "that holds both uses")
        seen.add(id(p))
        mine.setdefault(p.dtype, []).append((name, p))
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if dist.is_initialized() else (0, 1)
    devices = {p.device for ps in mine.values() for _, p in ps}
    if len(devices) > 1:
        raise ValueError(f"{type(module).__name__} has parameters on {sorted(map(str, devices))}; "
                         "move the module to one device before fully_shard")
    policy = _policy(granularity)
    groups = []
    for dtype in sorted(mine, key=str):
        names, params = zip(*mine[dtype], strict=True)
        if not dtype.is_floating_point and mp_policy is not None:
            raise ValueError(f"parameter '{names[0]}' is {dtype}; mixed precision needs floating parameters")
        try:
            layout = plan_unit(list(names), [tuple(p.shape) for p in params], world, policy)
        except ragckpt.LayoutError as e:
            raise ValueError(f"cannot lay out the {dtype} parameters of {type(module).__name__} on {world} "
                             f"ranks: {e}") from None
        compute = (mp_policy.param_dtype if mp_policy and mp_policy.param_dtype else dtype)
        reduce = (mp_policy.reduce_dtype if mp_policy and mp_policy.reduce_dtype else compute)
        groups.append(FlatGroup(list(names), list(params), layout, compute, reduce, group, rank, world))
    module.__dict__["_ragfsdp_unit"] = Unit(module, groups, mp_policy, reshard_after_forward)
    if nested:  # a unit over units (the root, as a rule) ends a model: the next one starts from even ranks
        owner_balance.reset()
    for ps in mine.values():
        for _, p in ps:
            _owner[p] = type(module).__name__
    return module


def _units(model: nn.Module) -> list[Unit]:
    make_root(model)
    units = [u for m in model.modules() if (u := unit_of(m)) is not None]
    if not units:
        raise ValueError(f"{type(model).__name__} has no ragfsdp.fully_shard unit; call fully_shard first")
    return sorted(units, key=lambda u: u.index)


def flat_groups(model: nn.Module) -> list[FlatGroup]:
    """Every group under `model`, in creation order of their units, then dtype name (same on all ranks)."""
    return [g for u in _units(model) for g in u.groups]


def set_requires_gradient_sync(model: nn.Module, requires_gradient_sync: bool) -> None:
    """Off: backward accumulates into the unsharded full-gradient buffers (kept allocated, one full
    copy of each unit's parameters in the compute dtype) and reduce-scatters nothing; on again, the
    next backward reduce-scatters the accumulated sum once."""
    for u in _units(model):
        u.requires_grad_sync = bool(requires_gradient_sync)


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Gradient accumulation without a reduce-scatter per micro-step (see set_requires_gradient_sync)."""
    set_requires_gradient_sync(model, False)
    try:
        yield
    finally:
        set_requires_gradient_sync(model, True)


def stats(model: nn.Module) -> dict[str, int]:
    """Totals since creation (or `reset_stats`): bytes copied by the engine outside collectives
    (`copy_bytes`: mixed-precision casts, gradients autograd did not accumulate in place) and the
    collectives' counts and payload bytes."""
    keys = ("copy_bytes", "all_gather_bytes", "reduce_scatter_bytes", "all_gathers", "reduce_scatters")
    groups = flat_groups(model)
    return {k: sum(getattr(g.stats, k) for g in groups) for k in keys}


def reset_stats(model: nn.Module) -> None:
    for g in flat_groups(model):
        for k in g.stats.__slots__:
            setattr(g.stats, k, 0)

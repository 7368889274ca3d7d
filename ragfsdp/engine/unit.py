"""A `fully_shard` unit: its flat groups and the hooks that gather, free and reduce them.

Schedule per step: the unit's pre-forward all-gathers (waiting on a prefetch if one was issued) and
issues the next unit's all-gather in the recorded forward order; its post-forward frees the
unsharded parameters when `reshard_after_forward` (never for the root, whose backward comes first)
and hooks the outputs so that, when their gradient arrives, the unit re-gathers, binds the gradient
views and prefetches the unit before it (the root, whose backward comes first, prefetches the last
unit of the forward). Each parameter's post-accumulate-grad hook counts; when all of the unit's
gradients are in, its groups' reduce-scatters are issued without waiting and everything unsharded
but the gradient buffers in flight is freed; the previous unit's reduce-scatters are then waited,
so one unit's reduction overlaps the next unit's backward and at most two units' full-gradient
buffers exist. A callback at the end of the backward does the same for units whose count never
completed (unused parameters, a unit outside the loss). The last unit's reductions (the root's, whose
embedding gradient comes last) are left in flight: reading or setting a `FlatGroup.grad` waits for
its group's, as does the group's next reduction.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from ragfsdp.engine.flat_group import FlatGroup
from ragfsdp.engine.mixed_precision import MixedPrecisionPolicy

_created = itertools.count()


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, Mapping):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def _cast(obj: Any, dtype: torch.dtype) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() and obj.dtype != dtype else obj
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_cast(v, dtype) for v in obj)
    if isinstance(obj, list):
        return [_cast(v, dtype) for v in obj]
    if isinstance(obj, dict):
        return {k: _cast(v, dtype) for k, v in obj.items()}
    return obj


class RootState:
    """What the units under one root share: their creation order and the recorded forward order."""

    def __init__(self, units: list[Unit]) -> None:
        self.units = units
        self.forward_order: list[Unit] = []
        self.recording = True
        self.callback_queued = False
        self.reducing: list[Unit] = []  # units whose reduce-scatters are in flight, oldest first

    def queue_end_of_backward(self) -> bool:
        """Queue `end_of_backward` once per backward; False outside a backward (nothing to queue on)."""
        if not self.callback_queued:
            try:
                torch.autograd.Variable._execution_engine.queue_callback(lambda: end_of_backward(self))
            except RuntimeError:
                return False
            self.callback_queued = True
        return True


class Unit:
    def __init__(self, module: nn.Module, groups: list[FlatGroup], mp: MixedPrecisionPolicy | None,
                 reshard_after_forward: bool) -> None:
        self.module = module
        self.groups = groups
        self.mp = mp
        self.reshard_after_forward = reshard_after_forward
        self.index = next(_created)
        self.root: RootState | None = None
        self.is_root = False
        self.requires_grad_sync = True
        self._expected = sum(p.requires_grad for g in groups for p in g.params)
        self._ready = 0
        self._pre_backward_done = False
        self._post_backward_done = False
        self.param_ids = {id(p) for g in groups for p in g.params}
        module.register_forward_pre_hook(self._pre_forward, with_kwargs=True)
        module.register_forward_hook(self._post_forward)
        for g in groups:
            for p in g.params:
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(self._on_grad)

    # -- forward -------------------------------------------------------------------------------------
    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self.root is None:
            make_root(module)
        root = self.root
        assert root is not None
        if root.recording and self not in root.forward_order:
            root.forward_order.append(self)
        for g in self.groups:
            g.unshard()
        for g in self.groups:
            g.wait()
        if not root.recording:
            nxt = self._neighbour(+1)
            if nxt is not None:
                for g in nxt.groups:
                    g.unshard(async_op=True)
        if self.mp is not None and self.mp.param_dtype is not None and self.mp.cast_forward_inputs:
            args, kwargs = _cast(args, self.mp.param_dtype), _cast(kwargs, self.mp.param_dtype)
        return args, kwargs

    def _post_forward(self, module: nn.Module, args: tuple, output: Any) -> Any:
        grad_on = torch.is_grad_enabled()
        if self.is_root:
            assert self.root is not None
            self.root.recording = False
            if not grad_on:  # no backward will free the root's or a prefetched unit's parameters
                for u in self.root.units:
                    u.reshard()
        elif self.reshard_after_forward:
            self.reshard()
        if grad_on:
            for t in _tensors(output):
                if t.requires_grad:
                    t.register_hook(self._pre_backward)
        if self.mp is not None and self.mp.output_dtype is not None:
            output = _cast(output, self.mp.output_dtype)
        return output

    def _neighbour(self, step: int) -> Unit | None:
        order = self.root.forward_order if self.root is not None else []
        if self not in order:
            return None
        i = order.index(self) + step
        return order[i] if 0 <= i < len(order) else None

    # -- backward ------------------------------------------------------------------------------------
    def _pre_backward(self, grad: torch.Tensor) -> None:
        if self._pre_backward_done:
            return
        self._pre_backward_done = True
        root = self.root
        assert root is not None
        root.queue_end_of_backward()
        for g in self.groups:
            g.unshard()
        for g in self.groups:
            g.wait()
            g.bind_grads()
        prev = root.forward_order[-1] if self.is_root and root.forward_order else self._neighbour(-1)
        if prev is not None and not prev.is_root:
            for g in prev.groups:
                g.unshard(async_op=True)

    def _on_grad(self, p: nn.Parameter) -> None:
        if not self._pre_backward_done:  # gradient reached before the outputs' hook (param used outside)
            for g in self.groups:
                if any(q is p for q in g.params):
                    g.bind_grads()
        self._ready += 1
        if self._ready == self._expected:
            self.post_backward()

    def post_backward(self) -> None:
        if self._post_backward_done:
            return
        self._post_backward_done = True
        root = self.root
        overlap = root is not None and root.queue_end_of_backward()  # else: nothing would wait for it
        for g in self.groups:
            if self.requires_grad_sync:
                g.bind_grads()  # gradients autograd made outside the buffer, if any, go in first
                g.reduce_grads(async_op=overlap)
            g.reshard()
        if overlap and self.requires_grad_sync:
            assert root is not None
            earlier, root.reducing = root.reducing, [self]
            for u in earlier:
                u.wait_reduce()

    def wait_reduce(self) -> None:
        for g in self.groups:
            g.wait_reduce()

    def reshard(self) -> None:
        for g in self.groups:
            g.reshard()

    def reset_backward(self) -> None:
        self._ready = 0
        self._pre_backward_done = False
        self._post_backward_done = False


def end_of_backward(root: RootState) -> None:
    for u in root.units:
        if not u._post_backward_done and (u._pre_backward_done or u._ready
                                          or any(g.full_grad is not None for g in u.groups)):
            u.post_backward()
        u.reshard()
        u.reset_backward()
    root.callback_queued = False


def unit_of(module: nn.Module) -> Unit | None:
    return module.__dict__.get("_ragfsdp_unit")


def make_root(model: nn.Module) -> RootState:
    """Bind the units under `model` to one root (root-relative names, shared forward order)."""
    top = unit_of(model)
    if top is not None and top.root is not None:
        return top.root
    found = [(name, m, unit_of(m)) for name, m in model.named_modules()]
    units = sorted((u for _, _, u in found if u is not None), key=lambda u: u.index)
    root = RootState(units)
    for name, _, u in found:
        if u is None:
            continue
        u.root = root
        u.is_root = u is top
        if u.groups and not u.groups[0].buffer_name:  # names bound once, by the first root
            for g in u.groups:
                g.bind_prefix(name + "." if name else "", name or "<root>")
    return root

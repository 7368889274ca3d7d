"""`Muon` on the local shards: Newton–Schulz on the rank that owns each matrix whole, AdamW for the rest.

Muon's update of a matrix needs the whole matrix (its Newton–Schulz orthogonalisation), so a sharded
Muon would have to gather it. Here the layout avoids that: `fully_shard(..., granularity=Muon.granularity)`
plans each 2-D parameter whole on one rank, whose shard then holds the entire gradient, momentum and
weight; that rank runs torch.optim.Muon's math on local views and the others skip the matrix.
Everything that is not a Muon matrix gets AdamW, as torch's Muon documentation advises.

State: `momentum_buffer` (torch's key) for the matrices and `exp_avg`/`exp_avg_sq` for the rest, each
in a buffer holding only this rank's pieces of those parameters (see `FlatOptimizer.subset_buffer`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ragfsdp.engine.flat_group import FlatGroup
from ragfsdp.optim.adamw import adamw_foreach
from ragfsdp.optim.base import FlatOptimizer, torch_hyperparameters
from ragfsdp.optim.state_buffer import StateBuffer


def newton_schulz(update: torch.Tensor, coefficients: tuple[float, float, float], steps: int,
                  eps: float) -> torch.Tensor:
    """torch.optim.Muon's quintic Newton–Schulz iteration, op for op (bf16, on the wide orientation),
    so the result is bit-identical to torch's for the same input."""
    if steps >= 100:
        raise ValueError(f"ns_steps={steps}: use fewer than 100 Newton-Schulz steps")
    a, b, c = coefficients
    x = update.bfloat16()
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x.T if tall else x


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: tuple[int, ...]) -> float:
    """torch.optim.Muon's learning-rate scaling by the matrix's shape."""
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr


def _default_filter(name: str, shape: tuple[int, ...]) -> bool:
    return len(shape) == 2


class Muon(FlatOptimizer):
    """torch.optim.Muon for the 2-D parameters `muon_filter` accepts, AdamW (`adamw_*`, lr defaulting to
    `lr`) for every other one. `param_groups[0]` is Muon's group, `param_groups[1]` AdamW's.

    Every Muon matrix must be held whole by one rank: shard with `granularity=Muon.granularity`."""

    @staticmethod
    def granularity(name: str, shape: tuple[int, ...]) -> str:
        """The `fully_shard` granularity Muon needs: 2-D parameters whole on one rank, the rest by rows."""
        return "whole" if len(shape) == 2 else "row"

    def __init__(self, model: nn.Module, lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, ns_coefficients: tuple[float, float, float] = (3.4445, -4.775, 2.0315),
                 eps: float = 1e-7, ns_steps: int = 5, adjust_lr_fn: str | None = None, *,
                 adamw_lr: float | None = None, adamw_betas: tuple[float, float] = (0.9, 0.95),
                 adamw_eps: float = 1e-8, adamw_weight_decay: float = 0.0,
                 muon_filter: Callable[[str, tuple[int, ...]], bool] = _default_filter) -> None:
        muon_hyper = torch_hyperparameters(torch.optim.Muon, lr=lr, weight_decay=weight_decay, momentum=momentum,
                                           nesterov=nesterov, ns_coefficients=tuple(ns_coefficients), eps=eps,
                                           ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn)
        adamw_hyper = torch_hyperparameters(torch.optim.AdamW, lr=lr if adamw_lr is None else adamw_lr,
                                            betas=tuple(adamw_betas), eps=adamw_eps, weight_decay=adamw_weight_decay)
        super().__init__(model, muon_hyper)
        shapes = {n: s for g in self.groups for n, s in zip(g.param_names, g.shapes, strict=True)}
        for n, s in shapes.items():
            if muon_filter(n, s) and len(s) != 2:
                raise ValueError(f"muon_filter accepted parameter '{n}' of shape {s}; Muon only updates 2-D matrices")
        matrices = [n for n in self.param_names if muon_filter(n, shapes[n])]
        others = [n for n in self.param_names if n not in set(matrices)]
        self.param_groups = [dict(muon_hyper, params=matrices), dict(adamw_hyper, params=others)]
        self.owner = self._owners(set(matrices))
        self.momentum: list[tuple[StateBuffer, dict]] = []
        self.exp_avg: list[tuple[StateBuffer, dict]] = []
        self.exp_avg_sq: list[tuple[StateBuffer, dict]] = []
        for g in self.groups:
            mine = [n for n in g.param_names if n in self.owner]
            rest = [n for n in g.param_names if n not in self.owner]
            self.momentum.append(self.subset_buffer(g, mine, "momentum_buffer"))
            self.exp_avg.append(self.subset_buffer(g, rest, "exp_avg"))
            self.exp_avg_sq.append(self.subset_buffer(g, rest, "exp_avg_sq"))

    def _owners(self, matrices: set[str]) -> dict[str, int]:
        """{matrix: the rank holding it whole}, checked from the global layouts (same on every rank)."""
        owner: dict[str, int] = {}
        for g in self.groups:
            seg = g.layout.segments()
            for s, n in enumerate(g.param_names):
                if n not in matrices:
                    continue
                numel = math.prod(g.shapes[s])
                runs = [(int(r), int(ln)) for sl, r, ln in zip(seg.slot, seg.rank, seg.length, strict=True)
                        if int(sl) == s]
                if numel and (len(runs) != 1 or runs[0][1] != numel):
                    raise ValueError(f"Muon matrix '{n}' is split over ranks {sorted(r for r, _ in runs)}; pass "
                                     "granularity=ragfsdp.optim.Muon.granularity to fully_shard so each is whole")
                owner[n] = runs[0][0] if runs else 0
        return owner

    def owner_flops(self) -> list[int]:
        """Newton–Schulz multiply-adds x2 per rank per step, from the owners: the balance of the layout."""
        ns_steps = int(self.param_groups[0]["ns_steps"])
        shapes = {n: s for g in self.groups for n, s in zip(g.param_names, g.shapes, strict=True)}
        out = [0] * self._world
        for n, r in self.owner.items():
            m, k = sorted(shapes[n][:2])
            out[r] += ns_steps * (4 * m * m * k + 2 * m ** 3)
        return out

    def state_buffers(self) -> list[StateBuffer]:
        return [sb for bufs in (self.momentum, self.exp_avg, self.exp_avg_sq) for sb, _ in bufs if sb.tensors]

    def _update(self, gi: int, group: FlatGroup) -> None:
        grad = group.grad
        assert grad is not None
        mom, mom_at = self.momentum[gi]
        for run in self.runs(gi, group, [n for n in group.param_names if n in self.owner]):
            assert run.pieces is not None
            for pc in run.pieces:
                view = slice(pc.offset, pc.offset + pc.length)
                at = mom_at[(pc.slot, pc.flat_start)]
                self._muon_one(group.shard[view].view(pc.shape), grad[view].view(pc.shape),
                               mom.local[at:at + pc.length].view(pc.shape), run.hyper)
        ea, ea_at = self.exp_avg[gi]
        eas, _ = self.exp_avg_sq[gi]
        for run in self.runs(gi, group, [n for n in group.param_names if n not in self.owner]):
            assert run.pieces is not None
            spans = [(slice(pc.offset, pc.offset + pc.length),
                      slice(ea_at[(pc.slot, pc.flat_start)], ea_at[(pc.slot, pc.flat_start)] + pc.length))
                     for pc in run.pieces]
            adamw_foreach([group.shard[a] for a, _ in spans], [grad[a] for a, _ in spans],
                          [ea.local[b] for _, b in spans], [eas.local[b] for _, b in spans], run.hyper, run.step)

    @staticmethod
    def _muon_one(param: torch.Tensor, grad: torch.Tensor, buf: torch.Tensor, hyper: dict[str, Any]) -> None:
        """torch.optim.Muon's single-tensor step for one whole matrix held locally."""
        lr, wd, momentum = float(hyper["lr"]), hyper["weight_decay"], hyper["momentum"]
        buf.lerp_(grad, 1 - momentum)
        update = grad.lerp(buf, momentum) if hyper["nesterov"] else buf
        update = newton_schulz(update, tuple(hyper["ns_coefficients"]), int(hyper["ns_steps"]), hyper["eps"])
        param.mul_(1 - lr * wd)
        param.add_(update, alpha=-adjusted_lr(lr, hyper["adjust_lr_fn"], tuple(param.shape)))

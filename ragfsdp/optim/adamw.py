"""`AdamW` on the local shards: one update per contiguous span of each flat buffer.

AdamW is elementwise, so updating a rank's whole shard at once is the same arithmetic as torch's
per-parameter loop: at one rank the parameters come out bit for bit as `torch.optim.AdamW(foreach=False)`
gives them. Moments follow the parameters' groups element for element (`exp_avg`, `exp_avg_sq`, torch's
keys); padding stays zero because its gradient and state are zero.

Speed (`adamw_flat`): a group whose parameters share their hyperparameters and step (the normal case)
is one span, the whole shard; on CPU it is updated in chunks of `CHUNK` elements, each chunk through
all of torch's single-tensor ops while it is in cache, with `denom` written into one small reused
scratch buffer instead of a fresh shard-sized temporary (whose page faults were half of the step).
`fused=True` runs `torch._fused_adamw_` instead: one pass, several times faster, the bits of
`torch.optim.AdamW(fused=True)` rather than of the unfused math. The moments are allocated at a
group's first step (as torch does), or when the checkpoint protocol first asks for them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ragfsdp.engine.flat_group import FlatGroup
from ragfsdp.optim.base import FlatOptimizer, Run, torch_hyperparameters
from ragfsdp.optim.state_buffer import StateBuffer


def check_adamw_group(hyper: dict[str, Any]) -> None:
    """Refuse hyperparameters torch's AdamW has but this update does not implement."""
    for key in ("amsgrad", "capturable", "differentiable"):
        if hyper.get(key):
            raise ValueError(f"param group option {key}=True is not supported by ragfsdp.optim.AdamW; set it to False")


def adamw_foreach(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                  exp_avg_sqs: list[torch.Tensor], hyper: dict[str, Any], step: float) -> None:
    """torch's single-tensor AdamW step, op for op, over lists of tensors sharing one step count."""
    check_adamw_group(hyper)
    lr, (beta1, beta2), eps, wd = float(hyper["lr"]), hyper["betas"], hyper["eps"], hyper["weight_decay"]
    if hyper.get("maximize"):
        grads = torch._foreach_neg(grads)
    if wd != 0:
        torch._foreach_mul_(params, 1 - lr * wd)
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
    step_size = lr / (1 - beta1 ** step)
    bias_correction2_sqrt = (1 - beta2 ** step) ** 0.5
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, bias_correction2_sqrt)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(params, exp_avgs, denom, value=-step_size)


CHUNK = 1 << 18  # elements per pass on CPU: the chunk's parameter, grad, moments and denom stay in cache


def adamw_flat(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
               hyper: dict[str, Any], step: float, scratch: torch.Tensor | None = None,
               chunk: int | None = None) -> None:
    """`adamw_foreach`'s arithmetic (the same ops, so the same bits) on one contiguous 1-D span, in
    place, `chunk` elements at a time (None: all at once). `denom` (and `-grad` with `maximize`) go into
    `scratch` (at least `chunk` elements, twice that with `maximize`), allocated here if None."""
    check_adamw_group(hyper)
    lr, (beta1, beta2), eps, wd = float(hyper["lr"]), hyper["betas"], hyper["eps"], hyper["weight_decay"]
    maximize = bool(hyper.get("maximize"))
    decay = 1 - lr * wd
    step_size = lr / (1 - beta1 ** step)
    bias_correction2_sqrt = (1 - beta2 ** step) ** 0.5
    n = param.numel()
    c = n if chunk is None else min(chunk, n)
    need = c * (2 if maximize else 1)
    if scratch is None or scratch.numel() < need:
        scratch = torch.empty(need, dtype=param.dtype, device=param.device)
    for a in range(0, n, max(c, 1)):
        b = min(n, a + c)
        p, g, m, v = param[a:b], grad[a:b], exp_avg[a:b], exp_avg_sq[a:b]
        denom = scratch[:b - a]
        if maximize:
            g = torch.neg(g, out=scratch[c:c + b - a])
        if wd != 0:
            p.mul_(decay)
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2)
        v.addcmul_(g, g, value=1 - beta2)
        torch.sqrt(v, out=denom)
        denom.div_(bias_correction2_sqrt)
        denom.add_(eps)
        p.addcdiv_(m, denom, value=-step_size)


def adamw_fused(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                exp_avg_sqs: list[torch.Tensor], hyper: dict[str, Any], step: float) -> None:
    """torch's fused AdamW kernel (`torch._fused_adamw_`, as `torch.optim.AdamW(fused=True)` calls it)
    over tensors sharing one step count."""
    check_adamw_group(hyper)
    if not params:  # a rank whose shard holds only padding
        return
    lr, (beta1, beta2), eps, wd = float(hyper["lr"]), hyper["betas"], hyper["eps"], hyper["weight_decay"]
    steps = [torch.tensor(float(step), dtype=torch.float32, device=params[0].device)] * len(params)
    torch._fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, [], steps, lr=lr, beta1=beta1, beta2=beta2,
                        weight_decay=wd, eps=eps, amsgrad=False, maximize=bool(hyper.get("maximize")))


def spans(run: Run, numel: int) -> list[tuple[int, int]]:
    """The contiguous `(start, stop)` ranges of a shard that `run` covers: the whole shard, or its
    pieces with neighbours merged."""
    if run.pieces is None:
        return [(0, numel)]
    out: list[list[int]] = []
    for pc in sorted(run.pieces, key=lambda pc: pc.offset):
        if out and out[-1][1] == pc.offset:
            out[-1][1] += pc.length
        else:
            out.append([pc.offset, pc.offset + pc.length])
    return [(a, b) for a, b in out]


def views(buf: torch.Tensor, run: Run) -> list[torch.Tensor]:
    """The tensors of `buf` (a group's shard, gradient or a buffer following it) that `run` covers."""
    if run.pieces is None:
        return [buf]
    return [buf[pc.offset:pc.offset + pc.length] for pc in run.pieces]


class AdamW(FlatOptimizer):
    """torch.optim.AdamW (decoupled weight decay) on the local shards; same arguments and defaults.

    `fused=True`: torch's fused kernel over one tensor per piece, bit for bit `torch.optim.AdamW(fused=True)`
    at one rank (not `fused=False`'s bits: the kernel rounds differently, and its vectorised loop and
    scalar tail differ, hence per piece rather than per shard). Moments are allocated at each group's
    first step; `checkpoint_buffers()` (so `ragfsdp.state` / `load_state`) allocates the missing ones
    as zeros, the state every first step starts from, and keeps them for `load_state` to fill."""

    granularity = None

    def __init__(self, model: nn.Module, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, maximize: bool = False,
                 fused: bool = False) -> None:
        hyper = torch_hyperparameters(torch.optim.AdamW, lr=lr, betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay, maximize=maximize)
        super().__init__(model, hyper)
        self.fused = fused
        self._moments: list[tuple[StateBuffer, StateBuffer] | None] = [None] * len(self.groups)
        self._scratch: dict[torch.dtype, torch.Tensor] = {}  # CPU only: 1-2 chunks for denom (and -grad)

    def _moments_of(self, gi: int) -> tuple[StateBuffer, StateBuffer]:
        mo = self._moments[gi]
        if mo is None:
            g = self.groups[gi]
            mo = self._moments[gi] = (self.moment_buffer(g, "exp_avg"), self.moment_buffer(g, "exp_avg_sq"))
        return mo

    @property
    def exp_avg(self) -> list[StateBuffer]:
        return [self._moments_of(gi)[0] for gi in range(len(self.groups))]

    @property
    def exp_avg_sq(self) -> list[StateBuffer]:
        return [self._moments_of(gi)[1] for gi in range(len(self.groups))]

    def state_buffers(self) -> list[StateBuffer]:
        return [*self.exp_avg, *self.exp_avg_sq]

    def reset_state(self) -> None:
        self._moments = [None] * len(self.groups)  # fresh: allocated again at the next step

    def _update(self, gi: int, group: FlatGroup) -> None:
        grad = group.grad
        assert grad is not None
        ea, eas = (sb.local for sb in self._moments_of(gi))
        shard = group.shard
        for run in self.runs(gi, group):
            if self.fused:  # one tensor per piece: the kernel's vector/tail split is per tensor, as torch's
                pcs = group.pieces() if run.pieces is None else run.pieces
                cut = [(pc.offset, pc.offset + pc.length) for pc in pcs]
                adamw_fused([shard[a:b] for a, b in cut], [grad[a:b] for a, b in cut], [ea[a:b] for a, b in cut],
                            [eas[a:b] for a, b in cut], run.hyper, run.step)
                continue
            cut = spans(run, shard.numel())
            chunk = CHUNK if shard.device.type == "cpu" else None
            scratch = None
            if chunk is not None:
                need = 2 * chunk if run.hyper.get("maximize") else chunk
                scratch = self._scratch.get(shard.dtype)
                if scratch is None or scratch.numel() < need:
                    scratch = self._scratch[shard.dtype] = torch.empty(need, dtype=shard.dtype)
            for a, b in cut:
                adamw_flat(shard[a:b], grad[a:b], ea[a:b], eas[a:b], run.hyper, run.step, scratch, chunk)

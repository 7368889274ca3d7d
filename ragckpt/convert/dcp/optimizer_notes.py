"""What a torch optimizer loading an export-dcp result will miss (a per-parameter `step`,
`param_groups`, hyperparameters torch's Adam keeps), said as warnings: on its own because the
checks know torch's optimizers, not the DCP format."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from ragckpt.convert.dcp.keys import (
    OPTIM_PREFIX,
    PARAM_GROUPS_PREFIX,
    PARAM_GROUPS_USER_KEY,
    decode_bytes,
)
from ragckpt.format.names import OPTIM_STATE_PREFIX

if TYPE_CHECKING:
    import torch
else:  # the CLI imports this module for its commands; torch comes in when one runs (see ragckpt.lazy)
    from ragckpt.lazy import torch

def optimizer_gaps(names: list[str], non_tensor_keys: Mapping[str, bytes] | Iterable[str]) -> list[str]:
    """What `set_optimizer_state_dict` / `torch.optim.Optimizer.load_state_dict` will miss in an
    export: torch's Adam keeps a `step` per parameter beside its moments, and every optimizer
    needs `param_groups`. A training engine that saved only the moments (with the step in user
    metadata) exports fine, but FSDP2's load then fails with "Missing key ... .step".
    `non_tensor_keys` maps each non-tensor key to its `torch.save` bytes where they are known: the
    groups of a nested optimizer state dict (FSDP2's default) are keyed by group index and name
    their parameters in `optim.param_groups.<i>.params`, which only the bytes say."""
    states: dict[str, set[str]] = {}
    model = set(n for n in names if not n.startswith(OPTIM_PREFIX))
    for n in names:
        if n.startswith(OPTIM_STATE_PREFIX):
            param, _, key = n[len(OPTIM_STATE_PREFIX):].rpartition(".")
            if param in model:
                states.setdefault(param, set()).add(key)
    out = []
    no_step = sorted(p for p, keys in states.items() if "step" not in keys and keys & {"exp_avg", "exp_avg_sq"})
    if no_step:
        out.append(f"optimizer state of {len(no_step)} parameter(s) has moments but no step (e.g. "
                   f"'{OPTIM_STATE_PREFIX}{no_step[0]}.step'); torch's Adam expects one per parameter, so save it "
                   "as a 0-d tensor beside the moments")
    groups: dict[str, set[str]] = {}
    for k in non_tensor_keys:
        if k.startswith(PARAM_GROUPS_PREFIX):
            param, _, hp = k[len(PARAM_GROUPS_PREFIX):].rpartition(".")
            groups.setdefault(param, set()).add(hp)
    if isinstance(non_tensor_keys, Mapping):
        for param, hps in _nested_groups(non_tensor_keys).items():
            groups.setdefault(param, set()).update(hps)
    if states and not groups:
        out.append("no optim.param_groups: an optimizer cannot load the state without them; record "
                   f"user['{PARAM_GROUPS_USER_KEY}'] = {{param: {{'lr': ..., 'betas': [...], ...}}}} at save")
    adam = sorted(p for p, keys in states.items() if keys & {"exp_avg", "exp_avg_sq"})
    if adam and groups:
        # dcp.load asks for every hyperparameter the live optimizer's groups hold: with one missing
        # it fails with "Missing key in checkpoint state_dict: optim.param_groups.<p>.<hp>"
        need = adam_group_keys()
        lacking = [(p, sorted(need - groups.get(p, set()))) for p in adam if need - groups.get(p, set())]
        if lacking:
            p, miss = lacking[0]
            out.append(f"optim.param_groups of {len(lacking)} parameter(s) with Adam moments lack hyperparameters "
                       f"torch's Adam and AdamW keep (for '{p}': {', '.join(miss)}), so dcp.load into them fails "
                       f"with \"Missing key ... {PARAM_GROUPS_PREFIX}{p}.{miss[0]}\"; record every key of the "
                       "optimizer's groups (optimizer.param_groups[i] without 'params') at save")
    return out


def _nested_groups(entries: Mapping[str, bytes]) -> dict[str, set[str]]:
    """{param: its group's hyperparameters} of the groups of a nested optimizer state dict
    (`optim.param_groups.<i>.<hp>` and `optim.param_groups.<i>.params`, a list of parameter
    names): `dcp.load` into a nested state dict asks for its groups by index, so each parameter
    there has what its group holds. A `params` entry that is no list of names is left unjudged."""
    by_group: dict[str, set[str]] = {}
    for k in entries:
        if k.startswith(PARAM_GROUPS_PREFIX):
            g, _, hp = k[len(PARAM_GROUPS_PREFIX):].rpartition(".")
            if g.isdigit():
                by_group.setdefault(g, set()).add(hp)
    out: dict[str, set[str]] = {}
    for g, hps in by_group.items():
        if "params" not in hps:
            continue
        try:
            params = decode_bytes(entries[f"{PARAM_GROUPS_PREFIX}{g}.params"])
        except Exception:  # noqa: BLE001 - the weights-only loader raises several kinds; then say nothing of it
            continue
        if isinstance(params, list | tuple) and all(isinstance(p, str) for p in params):
            for p in params:
                out.setdefault(p, set()).update(hps - {"params"})
    return out


def adam_group_keys() -> set[str]:
    """The hyperparameters every group of torch's Adam and AdamW holds in the installed torch (11 in
    torch 2.13, `lr` to `decoupled_weight_decay`): what `dcp.load` into either will ask for."""
    p = [torch.zeros(1, requires_grad=True)]
    adam, adamw = (set(cls(p).param_groups[0]) - {"params"} for cls in (torch.optim.Adam, torch.optim.AdamW))
    return adam & adamw



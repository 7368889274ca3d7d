"""How DCP state-dict keys and ragckpt tensor names map onto each other (see docs/CONVERT_DCP.md),
and how DCP's non-tensor entries (optimizer hyperparameters, user objects) are carried in a ragckpt
checkpoint's user metadata. Import, export and the FSDP2 integration all name tensors through
here, so the three agree on every name."""

from __future__ import annotations

import io
import math
from typing import TYPE_CHECKING, Any

from ragckpt.errors import FormatError
from ragckpt.format.names import RESERVED_PREFIXES

if TYPE_CHECKING:
    import torch
else:  # the CLI imports this module for its commands; torch comes in when one runs (see ragckpt.lazy)
    from ragckpt.lazy import torch

MODEL_PREFIX = "model."
OPTIM_PREFIX = "optim."
EXTRA_PREFIX = "extra."
PARAM_GROUPS_PREFIX = "optim.param_groups."
USER_KEY = "dcp"
PARAM_GROUPS_USER_KEY = "optim.param_groups"
MAX_CARRIED_BYTES = 16 << 20  # non-tensor entries ride in the JSON manifest: keep them small


# -- key mapping -----------------------------------------------------------------------------------

def detect_model_prefix(tensor_keys: list[str]) -> str:
    """`model.` when the save used the `{"model": ..., "optim": ...}` convention, else "" (a bare
    `model.state_dict()` was saved and its keys are already parameter names). Keys under `model.`
    mean the convention unless every other key (optimizer keys aside) is a parameter of its own
    (`lm_head.weight`, `score.bias`): that is a bare Hugging Face model, whose names start with
    `model.` too (`model.embed_tokens.weight`). Other top-level entries (`rng`, `tp.col`,
    `optimizer.*`) sit beside a wrapped model. Flattened optimizer state settles it first where there
    is any: `optim.state.<fqn>.<key>` names each parameter as the model calls it, so its FQNs are
    either the keys themselves (a bare model) or the keys without `model.` (the convention; an EMA
    copy saved beside it as `ema.*` would otherwise pass for a bare model's own parameters).
    `import_dcp(model_prefix=...)` overrides the guess."""
    if not any(k.startswith(MODEL_PREFIX) for k in tensor_keys):
        return ""
    keys = set(tensor_keys)
    state = "optim.state."
    fqns = {k[len(state):].rsplit(".", 1)[0] for k in tensor_keys if k.startswith(state) and "." in k[len(state):]}
    bare = sum(f in keys for f in fqns)
    wrapped = sum(MODEL_PREFIX + f in keys for f in fqns)
    if bare != wrapped:
        return "" if bare > wrapped else MODEL_PREFIX
    others = [k for k in tensor_keys if not k.startswith((MODEL_PREFIX, OPTIM_PREFIX))]
    return "" if others and all(k.endswith((".weight", ".bias")) for k in others) else MODEL_PREFIX


def dcp_key_to_name(key: str, model_prefix: str) -> str:
    """ragckpt tensor name of a DCP tensor key (injective; `name_to_dcp_key` inverts it)."""
    if key.startswith(OPTIM_PREFIX):
        return key
    if key.startswith(model_prefix):
        rest = key[len(model_prefix):]
        if rest and not rest.startswith(RESERVED_PREFIXES):
            return rest
    return EXTRA_PREFIX + key


def name_to_dcp_key(name: str, model_prefix: str) -> str:
    if name.startswith(OPTIM_PREFIX):
        return name
    if name.startswith(EXTRA_PREFIX):
        return name[len(EXTRA_PREFIX):]
    return model_prefix + name


def jsonable(v: Any) -> Any:
    """A JSON view of a decoded hyperparameter, or raises TypeError (tuples become lists)."""
    if v is None or isinstance(v, bool | int | str):
        return v
    if isinstance(v, float):
        if not math.isfinite(v):
            raise TypeError("non-finite float")
        return v
    if isinstance(v, list | tuple):
        return [jsonable(x) for x in v]
    raise TypeError(type(v).__name__)


def param_groups_view(decoded: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """`{param_fqn: {hparam: value}}` from decoded `optim.param_groups.*` entries, for both DCP layouts:
    flattened (`optim.param_groups.<fqn>.<hp>`, what `flatten_optimizer_state_dict=True` saves) and
    nested (`optim.param_groups.<i>.<hp>` with `optim.param_groups.<i>.params` listing the fqns)."""
    groups: dict[str, dict[str, Any]] = {}
    for key, v in decoded.items():
        if key.startswith(PARAM_GROUPS_PREFIX):
            mid, _, hp = key[len(PARAM_GROUPS_PREFIX):].rpartition(".")
            if mid and hp:
                groups.setdefault(mid, {})[hp] = v
    out: dict[str, dict[str, Any]] = {}
    for mid, hps in groups.items():
        params = hps.get("params")
        if isinstance(params, list) and all(isinstance(p, str) for p in params):
            rest = {k: v for k, v in hps.items() if k != "params"}
            for p in params:
                out.setdefault(p, {}).update(rest)
        else:
            out.setdefault(mid, {}).update(hps)
    return out


def groups_by_param(ck: Any) -> dict[str, dict]:
    """Checkpoint `ck`'s `optim.param_groups` user metadata as {param: {hyperparameter: value}}: as
    ENGINE.md has it, or torch's own form, a list of groups each naming its parameters in `params`.
    Anything else is refused in one line (the hyperparameters could not be restored or exported)."""
    groups = ck.user.get(PARAM_GROUPS_USER_KEY) or {}
    if isinstance(groups, dict) and all(isinstance(h, dict) for h in groups.values()):
        return groups
    if isinstance(groups, list) and all(
            isinstance(g, dict) and isinstance(g.get("params"), list) and all(isinstance(p, str) for p in g["params"])
            for g in groups):
        return {p: {k: v for k, v in g.items() if k != "params"} for g in groups for p in g["params"]}
    raise FormatError(f"{ck.url}: user metadata '{PARAM_GROUPS_USER_KEY}' is neither the {{param: {{hyperparameter: "
                      "value}} mapping nor a list of groups with 'params' lists (torch's optimizer param_groups), "
                      "so the optimizer's hyperparameters cannot be read; see docs/ENGINE.md")


def dcp_user_metadata(*, model_prefix: str, world_size: int | None, carried: dict[str, str],
                      decoded: dict[str, Any], planner_data: dict[str, list], **more: Any) -> dict[str, Any]:
    """The user metadata of a checkpoint made from a DCP-style state dict (by import-dcp or
    `save_state_dict`): the `dcp` record export-dcp reads back (the non-tensor entries' bytes,
    base64, and where each key sat in the nested state dict) and the readable `optim.param_groups`
    view of the hyperparameters. `more`: further fields of the record (the source, DCP's version)."""
    user: dict[str, Any] = {USER_KEY: {**more, "world_size": world_size, "model_prefix": model_prefix,
                                       "bytes": carried, "planner_data": planner_data}}
    groups = param_groups_view(decoded)
    if groups:
        user[PARAM_GROUPS_USER_KEY] = groups
    return user


def default_planner_path(key: str) -> tuple[str, ...]:
    """How DCP's flattening would have named `key`: `(top-level key, rest)`, as a save of
    `{"model": model_sd, "optim": flattened_optim_sd}` records it."""
    head, sep, rest = key.partition(".")
    return (head, rest) if sep and rest else (key,)


def decode_bytes(raw: bytes) -> Any:
    """A non-tensor DCP entry is `torch.save(obj)`; decode it with torch's safe (weights-only) loader."""
    return torch.load(io.BytesIO(raw), weights_only=True)


"""Tensor naming convention shared by the engine, the resharder and the converters.

Model weights keep their plain fully-qualified parameter name (`model.layers.0.mlp.up_proj.weight`,
exactly the Hugging Face / `model.state_dict()` key). Optimizer state is keyed by parameter name the
way PyTorch DCP flattens an optimizer state dict: `optim.state.<param>.<key>` (e.g. Adam's `exp_avg`,
`exp_avg_sq`, `step`). Per-parameter-group hyperparameters are scalars and travel in the user
metadata under `optim.param_groups`. Anything under `extra.` is auxiliary engine state.
"""

from __future__ import annotations

OPTIM_STATE_PREFIX = "optim.state."
RESERVED_PREFIXES = ("optim.", "extra.")


def is_text(name: str) -> bool:
    """Whether `name` is Unicode text UTF-8 can encode. JSON parsers let a lone surrogate through
    (`"a\\ud800"`), which the checkpoint's metadata, safetensors headers and terminals cannot carry."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def all_text(names: list[str]) -> bool:
    """`all(map(is_text, names))` with one encode: a lone surrogate stays unpaired when strs are
    joined, so the joined text encodes exactly when every name does."""
    return is_text("".join(names))


def is_model_weight(name: str) -> bool:
    """True for model parameters and buffers (what export-hf writes by default)."""
    return not name.startswith(RESERVED_PREFIXES)


def optim_state_name(param: str, key: str) -> str:
    return f"{OPTIM_STATE_PREFIX}{param}.{key}"


def split_optim_state_name(name: str, params: set[str] | None = None) -> tuple[str, str] | None:
    """(param, key) of an optimizer-state tensor name, or None. With `params`, the longest known
    parameter prefix wins (parameter names contain dots too)."""
    if not name.startswith(OPTIM_STATE_PREFIX):
        return None
    rest = name[len(OPTIM_STATE_PREFIX) :]
    if params:
        for i in range(len(rest) - 1, 0, -1):
            if rest[i] == "." and rest[:i] in params:
                return rest[:i], rest[i + 1 :]
    param, _, key = rest.rpartition(".")
    return (param, key) if param else None

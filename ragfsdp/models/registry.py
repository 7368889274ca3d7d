"""Named models for `ragfsdp.train`: which module to build and which of its submodules are the
transformer blocks that `fully_shard` makes units of (the root then owns embeddings and head).

Everything is built from a config with seeded random weights; nothing is downloaded. A path to a
Hugging Face config.json builds that architecture with `AutoModelForCausalLM.from_config`.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Callable

import torch
from torch import nn

from ragfsdp.models.gpt import GPT, GPTConfig


class ModelError(ValueError):
    """The model asked for cannot be built (unknown name, unreadable or unsupported config)."""


def _transformers():  # noqa: ANN202 - a module
    try:
        import transformers
    except ImportError:
        raise ModelError("this model needs the transformers package (pip install transformers)") from None
    return transformers


def _llama(**dims: int) -> nn.Module:
    t = _transformers()
    return t.LlamaForCausalLM(t.LlamaConfig(tie_word_embeddings=False, **dims))


def _gpt_small() -> nn.Module:
    return GPT(GPTConfig(vocab_size=512, n_layer=4, n_head=4, d_model=128, max_seq_len=256))


def _tiny_llama() -> nn.Module:
    return _llama(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def _llama_50m() -> nn.Module:
    # 32k vocabulary, 6 layers of width 512: about 50.5M parameters, a third of them in the blocks
    return _llama(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=6,
                  num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024)


MODELS: dict[str, Callable[[], nn.Module]] = {"gpt-small": _gpt_small, "tiny-llama": _tiny_llama,
                                              "llama-50m": _llama_50m}


def _from_config_json(path: str) -> nn.Module:
    t = _transformers()
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise ModelError(f"cannot read the model config {path}: {e}") from None
    if not isinstance(cfg, dict) or not isinstance(cfg.get("model_type"), str):
        raise ModelError(f"{path} is not a Hugging Face config.json (no \"model_type\")")
    kind = cfg.pop("model_type")
    try:
        config = t.AutoConfig.for_model(kind, **cfg)
        return t.AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError, TypeError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ModelError(f"{path}: cannot build a causal LM of model_type {kind!r}: {msg}") from None


def _self_contained(block: nn.Module, uses: Counter) -> bool:
    """No parameter of `block` is also used outside it (a tied embedding must stay with the root,
    where both of its uses are)."""
    inside = Counter(id(p) for _, p in block.named_parameters(remove_duplicate=False))
    return all(uses[pid] == n for pid, n in inside.items())


def blocks_of(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks, in order: a GPT's `blocks`, or the modules of a transformers model's
    `_no_split_modules` classes (what it declares cannot be split across devices, i.e. its layers),
    else the largest ModuleList; a module sharing a parameter with the rest of the model is left to
    the root."""
    if isinstance(model, GPT):
        return list(model.blocks)
    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    kinds = set(getattr(model, "_no_split_modules", None) or ())
    found = [m for m in model.modules() if type(m).__name__ in kinds and m is not model]
    if not found:
        lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m)]
        found = list(max(lists, key=lambda ml: sum(p.numel() for p in ml.parameters()))) if lists else []
    outer = [m for m in found if not any(m is not o and any(m is x for x in o.modules()) for o in found)]
    return [m for m in outer if _self_contained(m, uses)]


def vocab_size_of(model: nn.Module) -> int:
    cfg = model.config
    return int(cfg.vocab_size)


def max_positions_of(model: nn.Module) -> int | None:
    """The longest sequence the model takes, when its config says (None: no limit known)."""
    cfg = model.config
    if isinstance(cfg, GPTConfig):
        return cfg.max_seq_len
    value = getattr(cfg, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) else None


def hf_config_of(model: nn.Module) -> dict | None:
    """The transformers config as a dict for `export_hf`; None for models transformers cannot load."""
    to_dict = getattr(model.config, "to_dict", None)
    return to_dict() if callable(to_dict) else None


def build(name_or_config_json: str, seed: int) -> tuple[nn.Module, list[nn.Module], int]:
    """(model, its blocks, vocabulary size) for a registry name or a config.json path, with weights
    drawn from `seed` (the same model on every rank and every world size)."""
    make = MODELS.get(name_or_config_json)
    if make is None and not (name_or_config_json.endswith(".json") or os.path.exists(name_or_config_json)):
        raise ModelError(f"unknown model {name_or_config_json!r}; choose one of {', '.join(MODELS)} "
                         "or give a path to a Hugging Face config.json")
    torch.manual_seed(seed)
    model = make() if make is not None else _from_config_json(name_or_config_json)
    return model, blocks_of(model), vocab_size_of(model)

"""Models for `ragfsdp.train`: a plain-torch GPT and a registry of named configs (no weights downloaded)."""

from ragfsdp.models.gpt import GPT, GPTConfig
from ragfsdp.models.registry import (
    MODELS,
    ModelError,
    blocks_of,
    build,
    hf_config_of,
    max_positions_of,
    vocab_size_of,
)

__all__ = ["GPT", "MODELS", "GPTConfig", "ModelError", "blocks_of", "build", "hf_config_of", "max_positions_of",
           "vocab_size_of"]

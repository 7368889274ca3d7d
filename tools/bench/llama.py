"""The transformers Llama the training benchmarks build on the spot (no download): the same seed on
every rank and for every engine compared, so all start from identical weights."""

from __future__ import annotations

from typing import Any


def make_llama(dims: tuple[int, int, int, int, int], vocab: int, seq_len: int) -> Any:
    """`dims` = (hidden, intermediate, layers, heads, kv heads); untied head, sdpa attention, seed 0."""
    import torch
    import transformers

    hidden, inter, layers, heads, kv = dims
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                                   num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                                   max_position_embeddings=max(seq_len, 128), tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)

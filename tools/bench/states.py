"""Llama-shaped benchmark states that every rank process can regenerate cheaply and identically."""

from __future__ import annotations

HIDDEN, INTER, KV, VOCAB = 2048, 5632, 256, 32000


def state_spec(gib: float) -> list[tuple[str, tuple[int, ...], str]]:
    spec = [("model.embed_tokens.weight", (VOCAB, HIDDEN), "bfloat16"), ("lm_head.weight", (VOCAB, HIDDEN), "bfloat16"),
            ("model.norm.weight", (HIDDEN,), "float32")]
    layer = [("self_attn.q_proj", (HIDDEN, HIDDEN)), ("self_attn.k_proj", (KV, HIDDEN)),
             ("self_attn.v_proj", (KV, HIDDEN)), ("self_attn.o_proj", (HIDDEN, HIDDEN)),
             ("mlp.gate_proj", (INTER, HIDDEN)), ("mlp.up_proj", (INTER, HIDDEN)), ("mlp.down_proj", (HIDDEN, INTER))]
    per_layer = sum(a * b for _, (a, b) in layer) * 2 + 2 * HIDDEN * 4
    fixed = 2 * VOCAB * HIDDEN * 2
    if gib * 2**30 < fixed + per_layer:  # small runs: shrink the vocabulary instead of dropping layers
        spec[0] = ("model.embed_tokens.weight", (1024, HIDDEN), "bfloat16")
        spec[1] = ("lm_head.weight", (1024, HIDDEN), "bfloat16")
        fixed = 2 * 1024 * HIDDEN * 2
    layers = max(1, round((gib * 2**30 - fixed) / per_layer))
    for i in range(layers):
        p = f"model.layers.{i}."
        spec += [(f"{p}{n}.weight", s, "bfloat16") for n, s in layer]
        spec += [(p + "input_layernorm.weight", (HIDDEN,), "float32"),
                 (p + "post_attention_layernorm.weight", (HIDDEN,), "float32")]
    return spec


def make_tensor(i: int, shape: tuple[int, ...], dtype: str):
    """Deterministic incompressible content, cheap to regenerate in every process: a random base
    block of int16 tiled with a per-tensor seed."""
    import torch

    n = 1
    for s in shape:
        n *= s
    g = torch.Generator().manual_seed(1000 + i)
    base = torch.randint(-2**15, 2**15, ((1 << 20) + 3 * i + 1,), dtype=torch.int16, generator=g)
    flat = base.repeat(-(-n // base.numel()))[:n] if n else base[:0]
    if dtype == "bfloat16":
        return flat.view(torch.bfloat16).reshape(shape).clone()
    return (flat.float() / 1024).reshape(shape)


def shard0_dtensor_state(gib: float, mesh, rank: int, world: int) -> dict:
    """This rank's FSDP2-style `Shard(0)` DTensors of the `state_spec(gib)` state (torch.chunk rows;
    ranks past the last chunk hold empty pieces): what a DCP save by `world` ranks starts from."""
    import torch
    from torch.distributed.tensor import DTensor, Shard

    state = {}
    for i, (name, shape, dt) in enumerate(state_spec(gib)):
        full = make_tensor(i, shape, dt)
        pieces = torch.chunk(full, world, dim=0)
        local = pieces[rank].clone() if rank < len(pieces) else full[:0].clone()
        state[name] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=full.shape,
                                         stride=full.stride())
        del full
    return state

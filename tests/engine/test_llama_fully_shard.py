"""A transformers LlamaForCausalLM built from a config trains under ragfsdp.fully_shard at 2 ranks."""

from __future__ import annotations

import torch

import ragfsdp
from tests.engine.dist_helpers import run_ranks

transformers = __import__("pytest").importorskip("transformers")


def make_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=61, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    return transformers.LlamaForCausalLM(cfg)


def tokens(step: int) -> torch.Tensor:
    return torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(step))


def sharded(rank: int, world: int) -> list[float]:
    model = make_llama()
    for layer in model.model.layers:
        ragfsdp.fully_shard(layer)
    ragfsdp.fully_shard(model)
    losses = []
    for step in range(2):
        ids = tokens(step)[rank:rank + 1]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        t = torch.tensor([loss.item()])
        torch.distributed.all_reduce(t)
        losses.append(t.item() / world)
        for g in ragfsdp.flat_groups(model):
            with torch.no_grad():
                g.shard.sub_(0.1 * g.grad)
            g.grad = None
    return losses


def test_llama_two_ranks(tmp_path):
    res = run_ranks(sharded, 2, tmp_path)
    model = make_llama()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref = []
    for step in range(2):
        ids = tokens(step)
        # mean of the two per-sequence losses, as the ranks average them (equal token counts)
        losses = [model(input_ids=ids[i:i + 1], labels=ids[i:i + 1]).loss for i in range(2)]
        loss = sum(losses) / 2
        loss.backward()
        ref.append(loss.item())
        opt.step()
        opt.zero_grad()
    torch.testing.assert_close(torch.tensor(res[0]), torch.tensor(ref), rtol=1e-4, atol=1e-5)

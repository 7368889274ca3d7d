"""no_sync accumulation and clip_grad_norm_ at 2 ranks vs torch on one process."""

from __future__ import annotations

import torch
from torch import nn

import ragfsdp
from tests.engine.dist_helpers import run_ranks
from tests.engine.models import batch, make_net
from tests.engine.test_fully_shard_correctness import merge, shard_net


def sharded(rank: int, world: int) -> dict:
    net = make_net()
    shard_net(net)
    with ragfsdp.no_sync(net):
        x, y = batch(0, rank, world)
        nn.functional.mse_loss(net(x), y).backward()
        assert all(g.grad is None for g in ragfsdp.flat_groups(net))
    x, y = batch(1, rank, world)
    nn.functional.mse_loss(net(x), y).backward()
    norm = ragfsdp.clip_grad_norm_(net, 0.1)
    out: dict = {}
    for g in ragfsdp.flat_groups(net):
        for pc in g.pieces():
            out.setdefault(pc.name, []).append((pc.flat_start, g.grad[pc.offset:pc.offset + pc.length].clone()))
    return {"norm": float(norm), "grads": out}


def test_no_sync_then_clip(tmp_path):
    res = run_ranks(sharded, 2, tmp_path)
    net = make_net()
    for step in (0, 1):
        x, y = batch(step, 0, 1)
        nn.functional.mse_loss(net(x), y).backward()
    norm = torch.nn.utils.clip_grad_norm_(net.parameters(), 0.1)
    shapes = {n: tuple(p.shape) for n, p in net.named_parameters()}
    got = merge([r["grads"] for r in res], shapes)
    assert abs(res[0]["norm"] - float(norm)) < 1e-4 * float(norm)
    for n, p in net.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=1e-5, atol=1e-6, msg=n)

"""Same model, seed and SGD under torch's FSDP2 and under ragfsdp (gloo, 2 ranks): same losses."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

import ragfsdp
from tests.engine.dist_helpers import run_ranks
from tests.engine.models import batch, make_net
from tests.engine.test_fully_shard_correctness import shard_net

STEPS, LR = 4, 0.05


def both(rank: int, world: int) -> tuple[list[float], list[float]]:
    mesh = init_device_mesh("cpu", (world,))
    ref = make_net()
    for b in ref.blocks:
        fsdp2_fully_shard(b, mesh=mesh)
    fsdp2_fully_shard(ref, mesh=mesh)
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    net = make_net()
    shard_net(net)
    a, b_ = [], []
    for step in range(STEPS):
        x, y = batch(step, rank, world)
        loss = nn.functional.mse_loss(ref(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        a.append(loss.item())
        loss = nn.functional.mse_loss(net(x), y)
        loss.backward()
        for g in ragfsdp.flat_groups(net):
            with torch.no_grad():
                g.shard.sub_(LR * g.grad)
            g.grad = None
        b_.append(loss.item())
    return a, b_


def test_fsdp2_parity(tmp_path):
    for fsdp2, ours in run_ranks(both, 2, tmp_path):
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(fsdp2), rtol=1e-5, atol=1e-6)

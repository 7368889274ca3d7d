"""ragfsdp.fully_shard at 1-4 gloo ranks vs a plain single-process training of the same model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ragfsdp
from tests.engine.dist_helpers import run_ranks
from tests.engine.models import batch, make_net

STEPS, LR = 3, 0.05


def shard_net(net: nn.Module, granularity: object = None, mp: ragfsdp.MixedPrecisionPolicy | None = None) -> None:
    for b in net.blocks:
        ragfsdp.fully_shard(b, granularity=granularity, mp_policy=mp)
    ragfsdp.fully_shard(net, granularity=granularity, mp_policy=mp)


def gather_params(net: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter rebuilt from the shards' pieces (all ranks' pieces: the caller merges)."""
    out: dict[str, list] = {}
    for g in ragfsdp.flat_groups(net):
        for pc in g.pieces():
            out.setdefault(pc.name, []).append((pc.flat_start, g.shard[pc.offset:pc.offset + pc.length].clone()))
    return out


def train_sharded(rank: int, world: int, granularity: object, mp: bool) -> dict:
    net = make_net()
    policy = ragfsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mp else None
    shard_net(net, granularity, policy)
    groups = ragfsdp.flat_groups(net)
    losses, grads = [], {}
    for step in range(STEPS):
        x, y = batch(step, rank, world)
        loss = nn.functional.mse_loss(net(x).float(), y)
        loss.backward()
        full = torch.tensor([loss.item()])
        torch.distributed.all_reduce(full)
        losses.append(full.item() / world)
        for g in groups:
            assert g.grad is not None and g.grad.shape == g.shard.shape and g.grad.dtype == g.shard.dtype
            if step == 0:
                for pc in g.pieces():
                    grads.setdefault(pc.name, []).append((pc.flat_start, g.grad[pc.offset:pc.offset + pc.length].clone()))
            with torch.no_grad():
                g.shard.sub_(LR * g.grad)
            g.grad = None
    meta = {g.buffer_name: (g.param_names, g.shapes, g.layout.shard_size) for g in groups}
    return {"losses": losses, "params": gather_params(net), "grads0": grads, "meta": meta,
            "padding_zero": all(_padding_is_zero(g) for g in groups)}


def _padding_is_zero(g: ragfsdp.FlatGroup) -> bool:
    covered = torch.zeros(g.shard.numel(), dtype=torch.bool)
    for pc in g.pieces():
        covered[pc.offset:pc.offset + pc.length] = True
    return bool((g.shard[~covered] == 0).all())


def train_reference(world: int, mp: bool) -> tuple[list[float], dict, dict]:
    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    losses, grads0 = [], {}
    for step in range(STEPS):
        # the mean over ranks of each rank's mean loss is the mean over the global batch
        x, y = batch(step, 0, 1, n=12 // world * world)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mp):
            out = net(x)
        loss = nn.functional.mse_loss(out.float(), y)
        loss.backward()
        losses.append(loss.item())
        if step == 0:
            grads0 = {n: p.grad.detach().clone() for n, p in net.named_parameters()}
        opt.step()
        opt.zero_grad()
    return losses, {n: p.detach().clone() for n, p in net.named_parameters()}, grads0


def merge(per_rank: list[dict], shapes: dict[str, tuple]) -> dict[str, torch.Tensor]:
    out = {}
    for name, shape in shapes.items():
        flat = torch.full((int(torch.tensor(shape).prod()) if shape else 1,), float("nan"))
        for r in per_rank:
            for start, piece in r.get(name, []):
                flat[start:start + piece.numel()] = piece.float()
        assert not flat.isnan().any(), f"{name}: some elements are on no rank"
        out[name] = flat.view(shape)
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_matches_single_process(tmp_path, world):
    res = run_ranks(train_sharded, world, tmp_path, None, False)
    ref_losses, ref_params, ref_grads = train_reference(world, False)
    shapes = {n: tuple(p.shape) for n, p in make_net().named_parameters()}
    assert all(r["padding_zero"] for r in res)
    assert res[0]["meta"] == res[-1]["meta"]
    names = [n for names, _, _ in res[0]["meta"].values() for n in names]
    assert sorted(names) == sorted(shapes)
    torch.testing.assert_close(torch.tensor(res[0]["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    grads = merge([r["grads0"] for r in res], shapes)
    params = merge([r["params"] for r in res], shapes)
    for n in shapes:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-5, atol=1e-6, msg=n)
        torch.testing.assert_close(params[n], ref_params[n], rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.parametrize("granularity", ["element", "whole", "rows:2", {"*.up.weight": "whole", "*": "element"}])
def test_granularities_at_three_ranks(tmp_path, granularity):
    res = run_ranks(train_sharded, 3, tmp_path, granularity, False)
    ref_losses, ref_params, _ = train_reference(3, False)
    shapes = {n: tuple(p.shape) for n, p in make_net().named_parameters()}
    torch.testing.assert_close(torch.tensor(res[0]["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    params = merge([r["params"] for r in res], shapes)
    for n in shapes:
        torch.testing.assert_close(params[n], ref_params[n], rtol=1e-5, atol=1e-6, msg=n)


def test_rows_are_not_split_and_uneven(tmp_path):
    res = run_ranks(train_sharded, 4, tmp_path, None, False)
    for names, shapes, _S in res[0]["meta"].values():
        for n, shp in zip(names, shapes, strict=True):
            pieces = [p for r in res for p in r["params"].get(n, [])]
            row = shp[-1] if len(shp) > 1 else 1
            assert all(start % row == 0 and t.numel() % row == 0 for start, t in pieces), n
    # 11-row weights over 4 ranks cannot split evenly
    assert any(len(shapes[i]) == 2 and shapes[i][0] % 4 for _, shapes, _ in res[0]["meta"].values()
               for i in range(len(shapes)))


def test_mixed_precision_bf16(tmp_path):
    res = run_ranks(train_sharded, 2, tmp_path, None, True)
    ref_losses, ref_params, _ = train_reference(2, True)
    shapes = {n: tuple(p.shape) for n, p in make_net().named_parameters()}
    torch.testing.assert_close(torch.tensor(res[0]["losses"]), torch.tensor(ref_losses), rtol=3e-2, atol=3e-2)
    params = merge([r["params"] for r in res], shapes)
    for n in shapes:
        assert params[n].dtype == torch.float32
        torch.testing.assert_close(params[n], ref_params[n], rtol=2e-2, atol=2e-2, msg=n)

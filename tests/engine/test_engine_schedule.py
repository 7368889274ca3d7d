"""The engine's schedule and accounting, observed through its collectives and counters (never timing):
prefetch order, async reduce-scatters (in flight during the previous unit's backward, bit for bit the
blocking and the native gloo results), `stats` counts and copies, and the one-line refusals."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import ragfsdp
from ragfsdp.engine import flat_group
from ragfsdp.engine.unit import unit_of
from tests.engine.dist_helpers import run_ranks
from tests.engine.models import batch, make_net
from tests.engine.test_fully_shard_correctness import shard_net

# the native collectives, as torch names them now (the old names warn)
_native_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_native_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.int32 if t.element_size() == 4 else torch.int16)


def _log_schedule(net: nn.Module, log: list[tuple[str, str, bool]], monkeypatch: pytest.MonkeyPatch) -> None:
    """Log each all-gather (whose full buffer, async or not) and the start of each unit's computation,
    forward (the first inner module's pre-hook) and backward (the last inner module's backward)."""
    names = {id(g.full): name for name, m in [("root", net), *((f"b{i}", b) for i, b in enumerate(net.blocks))]
             for g in unit_of(m).groups}
    real = flat_group.collectives.all_gather

    def gather(full: torch.Tensor, shard: torch.Tensor, group: object, *, async_op: bool = False) -> object:
        log.append(("gather", names[id(full)], async_op))
        return real(full, shard, group, async_op=async_op)
    monkeypatch.setattr(flat_group.collectives, "all_gather", gather)
    for i, b in enumerate(net.blocks):
        b.norm.register_forward_pre_hook(lambda m, a, i=i: log.append(("forward", f"b{i}", False)))
        b.down.register_full_backward_pre_hook(lambda m, g, i=i: log.append(("backward", f"b{i}", False)))


def test_prefetch_issues_the_next_gather_before_the_current_unit_computes(monkeypatch):
    net = make_net(layers=3)
    shard_net(net)
    x, y = batch(0, 0, 1)
    nn.functional.mse_loss(net(x), y).backward()  # the first step records the forward order
    log: list[tuple[str, str, bool]] = []
    _log_schedule(net, log, monkeypatch)
    nn.functional.mse_loss(net(x), y).backward()
    gathers = [e for e in log if e[0] == "gather"]
    # forward: the root, then each block prefetched; backward: the root's prefetches the last block,
    # each block's the one before it (the root's parameters are kept from the forward)
    assert gathers == [("gather", "root", False)] + [("gather", f"b{i}", True) for i in (0, 1, 2, 2, 1, 0)]
    at = [k for k, e in enumerate(log) if e[0] == "gather"]
    fwd, bwd = at[1:4], at[4:]
    for i in (1, 2):  # b{i}'s gather is issued before b{i-1} computes, so it overlaps b{i-1}'s forward
        assert fwd[i] < log.index(("forward", f"b{i - 1}", False))
    for k, i in enumerate((2, 1, 0)):  # b{i}'s re-gather is issued before b{i+1}'s backward computes
        nxt = ("backward", f"b{i + 1}", False) if i < 2 else ("backward", "b2", False)
        assert bwd[k] < log.index(nxt)


def _async_vs_blocking(rank: int, world: int) -> dict:
    """Per group: the gradient the engine produced in backward (async reduce-scatters), the same
    backward's buffer reduced by a blocking `reduce_grads`, and the native gloo reduce-scatter of it.
    Also whether block 1's reduction was still in flight while block 0's backward ran, and which were
    still in flight after the backward."""
    x, y = batch(0, rank, world)
    net = make_net(layers=2)
    shard_net(net)
    in_flight = []
    b1_groups = ragfsdp.engine.unit.unit_of(net.blocks[1]).groups
    net.blocks[0].down.register_full_backward_pre_hook(
        lambda m, g: in_flight.append(all(gr.reduce_pending for gr in b1_groups)))
    nn.functional.mse_loss(net(x), y).backward()
    groups = ragfsdp.flat_groups(net)
    root_groups = unit_of(net).groups
    # only the last unit to start its reductions (the root: its embedding gradient comes last) is left
    # in flight after the backward; reading `grad` finishes it
    pending_after = [g.reduce_pending for g in groups] == [any(g is r for r in root_groups) for g in groups]
    engine = [g.grad.clone() for g in groups]
    pending_after = pending_after and not any(g.reduce_pending for g in groups)

    ref = make_net(layers=2)
    shard_net(ref)
    with ragfsdp.no_sync(ref):  # keeps each full-gradient buffer, reduces nothing
        nn.functional.mse_loss(ref(x), y).backward()
    native, blocking = [], []
    for g in ragfsdp.flat_groups(ref):
        full = g.full_grad.clone()
        out = torch.empty(g.layout.shard_size)
        _native_reduce_scatter(out, full)
        native.append(out / world)
        g.reduce_grads()
        blocking.append(g.grad.clone())
    # the all-gather path too, against the native one
    gathered = []
    for g in groups:
        mine = torch.empty(g.full.numel())
        flat_group.collectives.all_gather(mine, g.grad, None)
        want = torch.empty(g.full.numel())
        _native_gather(want, g.grad)
        gathered.append(torch.equal(_bits(mine), _bits(want)))
    return {"engine": engine, "blocking": blocking, "native": native, "in_flight": in_flight,
            "pending_after": pending_after, "gathered": gathered}


def test_async_reduce_scatter_equals_blocking_and_native_bit_for_bit(tmp_path):
    for res in run_ranks(_async_vs_blocking, 3, tmp_path):
        assert res["in_flight"] == [True], "block 1's reduce-scatter was waited before block 0's backward"
        assert res["pending_after"]
        assert all(res["gathered"])
        for e, b, n in zip(res["engine"], res["blocking"], res["native"], strict=True):
            assert torch.equal(_bits(e), _bits(b)) and torch.equal(_bits(e), _bits(n))


def _counts(rank: int, world: int) -> list[dict]:
    out = []
    for reshard in (True, False):
        net = make_net(layers=3)
        for b in net.blocks:
            ragfsdp.fully_shard(b, reshard_after_forward=reshard)
        ragfsdp.fully_shard(net)
        groups = ragfsdp.flat_groups(net)
        for step in range(2):
            ragfsdp.engine.reset_stats(net)
            x, y = batch(step, rank, world)
            nn.functional.mse_loss(net(x), y).backward()
            for g in groups:
                g.grad = None
            st = ragfsdp.engine.stats(net)
            full = sum(g.full.numel() * 4 for g in groups)
            out.append({"reshard": reshard, "groups": len(groups), "stats": st, "full_bytes": full,
                        "root_full_bytes": ragfsdp.engine.unit.unit_of(net).groups[0].full.numel() * 4})
    return out


def test_stats_counts_per_step_fp32(tmp_path):
    for res in run_ranks(_counts, 2, tmp_path):
        for r in res:
            st, G = r["stats"], r["groups"]
            assert st["copy_bytes"] == 0 and st["reduce_scatters"] == G and st["reduce_scatter_bytes"] == r["full_bytes"]
            if r["reshard"]:  # blocks are gathered again for their backward, the root is kept
                assert st["all_gathers"] == 2 * G - 1
                assert st["all_gather_bytes"] == 2 * r["full_bytes"] - r["root_full_bytes"]
            else:
                assert st["all_gathers"] == G and st["all_gather_bytes"] == r["full_bytes"]


def test_stats_copy_bytes_are_the_mixed_precision_casts():
    net = make_net(layers=2)
    shard_net(net, mp=ragfsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    groups = ragfsdp.flat_groups(net)
    x, y = batch(0, 0, 1)
    nn.functional.mse_loss(net(x).float(), y).backward()
    for g in groups:
        g.grad = None
    ragfsdp.engine.reset_stats(net)
    nn.functional.mse_loss(net(x).float(), y).backward()
    st = ragfsdp.engine.stats(net)
    gathers = 2 * len(groups) - 1
    S = [g.layout.shard_size for g in groups]
    assert st["all_gathers"] == gathers
    # each gather casts the fp32 shard to bf16 (root once, blocks twice); each reduction casts the
    # bf16 full gradient to fp32 (world size 1: full = shard size)
    want = 2 * (2 * sum(S) - S[-1]) + 4 * sum(S)
    assert st["copy_bytes"] == want
    assert all(g.grad.dtype == torch.float32 for g in groups)


def test_sharding_a_module_twice_is_a_one_line_error():
    net = make_net()
    shard_net(net)
    with pytest.raises(ValueError) as e:
        ragfsdp.fully_shard(net.blocks[0])
    assert "already sharded" in str(e.value) and "\n" not in str(e.value)


def test_a_parameter_shared_between_two_units_is_a_one_line_error():
    net = make_net()
    net.blocks[1].up.weight = net.blocks[0].up.weight  # siblings sharing a weight
    ragfsdp.fully_shard(net.blocks[0])
    with pytest.raises(ValueError) as e:
        ragfsdp.fully_shard(net.blocks[1])
    assert "shared between two units" in str(e.value) and "\n" not in str(e.value)
    net = make_net()
    net.inp.bias = net.blocks[0].norm.weight  # a block's weight also used by the root's own layer
    ragfsdp.fully_shard(net.blocks[0])
    with pytest.raises(ValueError) as e:
        ragfsdp.fully_shard(net)
    assert "shared with the sharded module 'blocks.0'" in str(e.value) and "\n" not in str(e.value)


def _subgroup(rank: int, world: int) -> dict | None:
    """Ranks 1 and 2 of 3 shard over their own gloo group: the broadcasts name global source ranks."""
    sub = dist.new_group([1, 2])
    if rank == 0:  # stays until the others are done: its teardown would close connections they still use
        dist.barrier()
        return None
    x, y = batch(0, rank - 1, 2)
    net = make_net(layers=2)
    for b in net.blocks:
        ragfsdp.fully_shard(b, group=sub)
    ragfsdp.fully_shard(net, group=sub)
    ref = make_net(layers=2)
    for b in ref.blocks:
        ragfsdp.fully_shard(b, group=sub)
    ragfsdp.fully_shard(ref, group=sub)
    nn.functional.mse_loss(net(x), y).backward()
    with ragfsdp.no_sync(ref):
        nn.functional.mse_loss(ref(x), y).backward()
    same = []
    for g, r in zip(ragfsdp.flat_groups(net), ragfsdp.flat_groups(ref), strict=True):
        out = torch.empty(g.layout.shard_size)
        _native_reduce_scatter(out, r.full_grad.clone(), group=sub)
        mine, want = torch.empty(g.full.numel()), torch.empty(g.full.numel())
        flat_group.collectives.all_gather(mine, g.shard, sub)
        _native_gather(want, g.shard, group=sub)
        same.append(torch.equal(_bits(g.grad), _bits(out / 2)) and torch.equal(_bits(mine), _bits(want)))
    dist.barrier()
    return {"same": same}


def test_a_sub_group_gathers_and_reduces_as_the_native_collectives(tmp_path):
    res = run_ranks(_subgroup, 3, tmp_path)
    assert res[0] is None and all(all(r["same"]) and r["same"] for r in res[1:])

"""ragfsdp.optim.AdamW and Muon on the local shards vs plain single-process torch.optim.AdamW / Muon.

One launch of 4 gloo ranks runs every multi-rank case on sub-groups of 2, 3 and 4 ranks (and 1 for
a checkpoint load), so the process start is paid once; the references run in the test process.
TinyNet's rows (6, 7, 11, 5) divide by none of 2, 3, 4: the layouts are uneven.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import ragckpt
import ragfsdp
import ragfsdp.optim
from tests.engine.dist_helpers import run_ranks
from tests.engine.models import batch, make_net
from tests.engine.test_fully_shard_correctness import gather_params, merge

STEPS, LR, N = 3, 0.05, 12
SAVE_AT, MORE = 2, 2  # checkpoint round trip: save after 2 steps at 2 ranks, then 2 more steps
BF16 = ragfsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
SHAPES = {n: tuple(p.shape) for n, p in make_net().named_parameters()}


# -- engine side (runs on the ranks) ---------------------------------------------------------------
def shard(net: nn.Module, kind: str, group: dist.ProcessGroup | None, mp: ragfsdp.MixedPrecisionPolicy | None,
          granularity: object = "auto") -> nn.Module:
    if granularity == "auto":
        granularity = ragfsdp.optim.Muon.granularity if kind == "muon" else ragfsdp.optim.AdamW.granularity
    for b in net.blocks:
        ragfsdp.fully_shard(b, group=group, granularity=granularity, mp_policy=mp)
    return ragfsdp.fully_shard(net, group=group, granularity=granularity, mp_policy=mp)


def make_opt(kind: str, net: nn.Module, lr: float = LR) -> ragfsdp.optim.FlatOptimizer:
    if kind == "adamw":
        return ragfsdp.optim.AdamW(net, lr=lr, weight_decay=0.1)
    return ragfsdp.optim.Muon(net, lr=lr, weight_decay=0.1)


def train(net: nn.Module, opt: ragfsdp.optim.FlatOptimizer, steps: range, rank: int, world: int,
          group: dist.ProcessGroup | None) -> list[float]:
    losses = []
    for step in steps:
        x, y = batch(step, rank, world, N)
        loss = nn.functional.mse_loss(net(x).float(), y)
        loss.backward()
        total = torch.tensor([loss.item()])
        dist.all_reduce(total, group=group)
        losses.append(total.item() / world)
        opt.step()
        opt.zero_grad()
    return losses


def state_pieces(opt: ragfsdp.optim.FlatOptimizer, rank: int) -> dict[str, list]:
    """Every state tensor's pieces on this rank, as checkpoint_buffers() gives them to ragfsdp.state."""
    layouts = {g.buffer_name: g.layout for g in opt.groups}
    out: dict[str, list] = {}
    for sb in opt.checkpoint_buffers():
        lay = layouts[sb.like] if sb.like is not None else sb.layout
        seg = lay.rank_segments(rank)
        for s, f, o, n in zip(seg.slot, seg.flat_start, seg.offset, seg.length, strict=True):
            out.setdefault(sb.tensors[int(s)], []).append((int(f), sb.local[int(o):int(o) + int(n)].clone()))
    return out


def padding_zero(opt: ragfsdp.optim.FlatOptimizer) -> bool:
    for g in opt.groups:
        covered = torch.zeros(g.shard.numel(), dtype=torch.bool)
        for pc in g.pieces():
            covered[pc.offset:pc.offset + pc.length] = True
        if not (g.shard[~covered] == 0).all():
            return False
    return True


def case(kind: str, rank: int, world: int, group: dist.ProcessGroup | None, mp: bool) -> dict:
    net = shard(make_net(), kind, group, BF16 if mp else None)
    opt = make_opt(kind, net)
    losses = train(net, opt, range(STEPS), rank, world, group)
    out = {"losses": losses, "params": gather_params(net), "state": state_pieces(opt, rank),
           "padding_zero": padding_zero(opt), "dtypes": {str(g.shard.dtype) for g in opt.groups}}
    if kind == "muon":
        out["flops"] = opt.owner_flops()
    return out


def refusal(rank: int, group: dist.ProcessGroup | None) -> str:
    net = shard(make_net(), "muon", group, None, granularity="element")
    try:
        ragfsdp.optim.Muon(net)
    except ValueError as e:
        return str(e)
    return "no error"


def save(kind: str, rank: int, group: dist.ProcessGroup, url: str) -> dict:
    net = shard(make_net(), kind, group, None)
    opt = make_opt(kind, net, lr=1e-3)
    for pg in opt.param_groups:  # set by the user after construction: the checkpoint must carry it
        pg["lr"] = LR
    train(net, opt, range(SAVE_AT), rank, 2, group)
    rec = ragckpt.save_shard(url, **ragfsdp.state(net, opt), save_id=str(SAVE_AT))
    recs = [None, None]
    dist.all_gather_object(recs, rec, group=group)
    if rank == 0:
        ragckpt.commit(url, rank_manifests=recs)
    return state_pieces(opt, rank)


def resume(kind: str, rank: int, world: int, group: dist.ProcessGroup, url: str) -> dict:
    net = shard(make_net(seed=7), kind, group, None)  # other weights: all must come from the checkpoint
    opt = make_opt(kind, net, lr=1e-3)
    ragfsdp.load_state(net, opt, url)
    loaded = state_pieces(opt, rank)
    lrs = [pg["lr"] for pg in opt.param_groups]
    losses = train(net, opt, range(SAVE_AT, SAVE_AT + MORE), rank, world, group)
    return {"loaded": loaded, "lrs": lrs, "losses": losses, "params": gather_params(net)}


def scenario(rank: int, world: int, tmp: str) -> dict:
    assert world == 4
    groups = {1: dist.new_group([0]), 2: dist.new_group([0, 1]), 3: dist.new_group([0, 1, 2]), 4: None}
    out: dict = {}
    for W in (2, 3, 4):
        for kind in ("adamw", "muon"):
            if rank < W:
                out[(kind, W, False)] = case(kind, rank, W, groups[W], False)
    for kind in ("adamw", "muon"):
        if rank < 2:
            out[(kind, 2, True)] = case(kind, rank, 2, groups[2], True)
    out["refusal"] = refusal(rank, groups[4])
    for kind in ("adamw", "muon"):
        url = f"{tmp}/ck_{kind}"
        if rank < 2:
            out[("saved", kind)] = save(kind, rank, groups[2], url)
        dist.barrier()
        for W in (3, 1):
            if rank < W:
                out[("resumed", kind, W)] = resume(kind, rank, W, groups[W], url)
    return out


@pytest.fixture(autouse=True)
def one_thread() -> object:
    """The references and the one-rank runs on one thread, as the ranks run: some CPU kernels (LayerNorm's
    backward) reduce in per-thread partial sums, so another thread count rounds differently."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], Path]:
    tmp = tmp_path_factory.mktemp("optim")
    return run_ranks(scenario, 4, tmp, str(tmp)), tmp


# -- references (plain single-process torch) --------------------------------------------------------
def torch_opts(kind: str, net: nn.Module, lr: float = LR) -> list[torch.optim.Optimizer]:
    if kind == "adamw":
        return [torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=0.1, foreach=False)]
    mats = [p for p in net.parameters() if p.ndim == 2]
    rest = [p for p in net.parameters() if p.ndim != 2]
    return [torch.optim.Muon(mats, lr=lr, weight_decay=0.1),
            torch.optim.AdamW(rest, lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, foreach=False)]


def reference(kind: str, steps: int, *, mp_ranks: int = 0) -> tuple[list[float], nn.Module, list]:
    """Plain training of the same model on the global batch. With `mp_ranks`, the engine's mixed
    precision replayed: `mp_ranks` slices, each through a bf16 copy of the fp32 master, their bf16
    gradients cast to fp32 and averaged (what the engine's fp32 reduce-scatter computes)."""
    net = make_net()
    opts = torch_opts(kind, net)
    losses = []
    for step in range(steps):
        if not mp_ranks:
            x, y = batch(step, 0, 1, N)
            loss = nn.functional.mse_loss(net(x), y)
            loss.backward()
            losses.append(loss.item())
        else:
            low = copy.deepcopy(net).to(torch.bfloat16)
            grads = [torch.zeros_like(p) for p in net.parameters()]
            total = 0.0
            for r in range(mp_ranks):
                x, y = batch(step, r, mp_ranks, N)
                loss = nn.functional.mse_loss(low(x.bfloat16()).float(), y)
                loss.backward()
                total += loss.item()
                for g, p in zip(grads, low.parameters(), strict=True):
                    g.add_(p.grad.float())
                    p.grad = None
            losses.append(total / mp_ranks)
            for p, g in zip(net.parameters(), grads, strict=True):
                p.grad = g.div_(mp_ranks)
        for o in opts:
            o.step()
            o.zero_grad()
    return losses, net, opts


def torch_state(net: nn.Module, opts: list[torch.optim.Optimizer]) -> dict[str, torch.Tensor]:
    names = {id(p): n for n, p in net.named_parameters()}
    return {f"optim.state.{names[id(p)]}.{k}": v for o in opts for p, st in o.state.items() for k, v in st.items()}


def merged_state(per_rank: list[dict]) -> dict[str, torch.Tensor]:
    shapes = {}
    for r in per_rank:
        for name in r:
            param = name.removeprefix("optim.state.").rsplit(".", 1)[0]
            shapes[name] = () if name.endswith(".step") else SHAPES[param]
    return merge(per_rank, shapes)


def assert_params(got: dict, net: nn.Module, tol: float, exact: bool = False) -> None:
    for n, p in net.named_parameters():
        if exact:
            assert torch.equal(got[n], p.detach()), n
        else:
            torch.testing.assert_close(got[n], p.detach(), rtol=tol, atol=tol, msg=lambda m, n=n: f"{n}: {m}")


# -- one process: bit for bit ----------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["adamw", "muon"])
def test_one_rank_is_bit_identical_to_torch(kind):
    net = shard(make_net(), kind, None, None)
    opt = make_opt(kind, net)
    losses = []
    for step in range(STEPS):
        x, y = batch(step, 0, 1, N)
        loss = nn.functional.mse_loss(net(x), y)
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    ref_losses, ref, opts = reference(kind, STEPS)
    assert losses == ref_losses
    assert_params(merge([gather_params(net)], SHAPES), ref, 0, exact=True)
    got, want = merged_state([state_pieces(opt, 0)]), torch_state(ref, opts)
    assert set(want) <= set(got)
    for k, v in want.items():
        assert torch.equal(got[k], v), k


def test_param_groups_lr_is_used_and_zero_grad():
    net = shard(make_net(), "adamw", None, None)
    opt = make_opt("adamw", net, lr=1e-3)
    opt.param_groups[0]["lr"] = LR
    x, y = batch(0, 0, 1, N)
    nn.functional.mse_loss(net(x), y).backward()
    opt.step()
    opt.zero_grad()
    assert all(g.grad is None for g in opt.groups)
    opt.step()  # no gradient: nothing moves, no step counted
    ref_losses, ref, _ = reference("adamw", 1)
    assert_params(merge([gather_params(net)], SHAPES), ref, 0, exact=True)
    assert opt.steps.tolist() == [1.0] * len(SHAPES)


# -- several ranks -----------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["adamw", "muon"])
def test_two_three_four_ranks_match_single_process(ranks, kind):
    res, _ = ranks
    ref_losses, ref, opts = reference(kind, STEPS)
    want = torch_state(ref, opts)
    for W in (2, 3, 4):
        per = [r[(kind, W, False)] for r in res[:W]]
        assert all(p["padding_zero"] for p in per), W
        torch.testing.assert_close(torch.tensor(per[0]["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        # the gradients' reduction order differs from one process's: fp32 rounding, then Adam/Muon on it
        assert_params(merge([p["params"] for p in per], SHAPES), ref, 2e-5)
        got = merged_state([p["state"] for p in per])
        for k, v in want.items():
            torch.testing.assert_close(got[k], v, rtol=2e-5, atol=2e-6, msg=f"{k} at {W} ranks")


@pytest.mark.parametrize("kind", ["adamw", "muon"])
def test_mixed_precision_two_ranks(ranks, kind):
    res, _ = ranks
    per = [r[(kind, 2, True)] for r in res[:2]]
    assert per[0]["dtypes"] == {"torch.float32"}  # the optimizer sees fp32 shards and gradients
    ref_losses, ref, _ = reference(kind, STEPS, mp_ranks=2)
    torch.testing.assert_close(torch.tensor(per[0]["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    assert_params(merge([p["params"] for p in per], SHAPES), ref, 2e-5)


def test_muon_refuses_split_matrices(ranks):
    res, _ = ranks
    msg = res[0]["refusal"]
    assert msg.startswith("Muon matrix '") and "granularity=ragfsdp.optim.Muon.granularity" in msg, msg
    assert "\n" not in msg


def test_muon_owners_hold_whole_matrices(ranks):
    res, _ = ranks
    for W in (2, 3, 4):
        flops = res[0][("muon", W, False)]["flops"]
        assert len(flops) == W and sum(flops) > 0
        for n, shape in SHAPES.items():
            if len(shape) == 2:  # every matrix on exactly one rank, in one piece
                assert sum(len(r[("muon", W, False)]["params"].get(n, [])) for r in res[:W]) == 1, (n, W)


@pytest.mark.parametrize("kind", ["adamw", "muon"])
def test_checkpoint_round_trip_two_to_three_and_one(ranks, kind):
    res, _ = ranks
    saved = merged_state([r[("saved", kind)] for r in res[:2]])
    ref_losses, ref, _ = reference(kind, SAVE_AT + MORE)
    for W in (3, 1):
        per = [r[("resumed", kind, W)] for r in res[:W]]
        loaded = merged_state([p["loaded"] for p in per])
        assert loaded.keys() == saved.keys()
        for k, v in saved.items():
            assert torch.equal(loaded[k].view(torch.int32), v.view(torch.int32)), f"{k} at {W} ranks"
        assert per[0]["lrs"] == [LR] * len(per[0]["lrs"])  # hyperparameters came back from the checkpoint
        torch.testing.assert_close(torch.tensor(per[0]["losses"]), torch.tensor(ref_losses[SAVE_AT:]),
                                   rtol=1e-5, atol=1e-6)
        assert_params(merge([p["params"] for p in per], SHAPES), ref, 2e-5)


def test_export_dcp_loads_into_torch_adamw(ranks):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    from ragckpt.convert.dcp import export_dcp

    res, tmp = ranks
    summary = export_dcp(str(tmp / "ck_adamw"), str(tmp / "dcp_adamw"))
    assert not [w for w in summary.warnings if "optim" in w and "hyperparameter" in w], summary.warnings
    net = make_net(seed=3)
    opt = torch.optim.AdamW(net.parameters(), lr=0.5)
    nn.functional.mse_loss(net(batch(0, 0, 1, N)[0]), batch(0, 0, 1, N)[1]).backward()
    opt.step()  # so the optimizer has state to fill
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    msd, osd = get_state_dict(net, opt, options=flat)
    target = {"model": msd, "optim": osd}
    dcp.load(target, checkpoint_id=str(tmp / "dcp_adamw"))
    set_state_dict(net, opt, model_state_dict=target["model"], optim_state_dict=target["optim"], options=flat)
    saved = merged_state([r[("saved", "adamw")] for r in res[:2]])
    names = {id(p): n for n, p in net.named_parameters()}
    for p, st in opt.state.items():
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(st[k], saved[f"optim.state.{names[id(p)]}.{k}"]), (names[id(p)], k)
    assert opt.param_groups[0]["lr"] == LR and opt.param_groups[0]["weight_decay"] == 0.1


def test_frozen_parameter_is_skipped_as_torch_does():
    net, ref = make_net(), make_net()
    ref.inp.bias.requires_grad_(False)
    net = shard(net, "adamw", None, None)
    opt, ropt = make_opt("adamw", net), torch_opts("adamw", ref)[0]
    net.inp.bias.requires_grad_(False)  # after the optimizer was made: seen at the next step
    for step in range(2):
        x, y = batch(step, 0, 1, N)
        for m, o in ((net, opt), (ref, ropt)):
            nn.functional.mse_loss(m(x), y).backward()
            o.step()
            o.zero_grad()
    assert_params(merge([gather_params(net)], SHAPES), ref, 0, exact=True)  # inp.bias: not even decayed
    assert opt.step_of("inp.bias") == 0.0 and opt.step_of("head.bias") == 2.0


def test_per_parameter_hyperparameters_from_a_checkpoint_split_the_group(tmp_path):
    net = shard(make_net(), "adamw", None, None)
    opt = make_opt("adamw", net)
    st = ragfsdp.state(net, opt)
    st["user"]["optim.param_groups"]["head.bias"]["lr"] = 0.5  # as if saved from a job with two groups
    ragckpt.commit(str(tmp_path / "ck"), rank_manifests=[ragckpt.save_shard(str(tmp_path / "ck"), **st)])
    net = shard(make_net(), "adamw", None, None)
    opt = make_opt("adamw", net)
    ragfsdp.load_state(net, opt, str(tmp_path / "ck"))
    assert sorted(pg["lr"] for pg in opt.param_groups) == [LR, 0.5]
    ref = make_net()
    head_bias = [ref.head.bias]
    rest = [p for p in ref.parameters() if p is not ref.head.bias]
    ropt = torch.optim.AdamW([{"params": rest}, {"params": head_bias, "lr": 0.5}], lr=LR, weight_decay=0.1,
                             foreach=False)
    for step in range(2):
        x, y = batch(step, 0, 1, N)
        for m, o in ((net, opt), (ref, ropt)):
            nn.functional.mse_loss(m(x), y).backward()
            o.step()
            o.zero_grad()
    assert_params(merge([gather_params(net)], SHAPES), ref, 0, exact=True)


def test_muon_filter_leaves_a_matrix_to_adamw_and_refuses_non_matrices():
    net = shard(make_net(), "muon", None, None)
    opt = ragfsdp.optim.Muon(net, lr=LR, weight_decay=0.1, muon_filter=lambda n, s: len(s) == 2 and n != "inp.weight")
    assert "inp.weight" in opt.param_groups[1]["params"] and "inp.weight" not in opt.owner
    ref = make_net()
    mats = [p for n, p in ref.named_parameters() if p.ndim == 2 and n != "inp.weight"]
    rest = [p for n, p in ref.named_parameters() if p.ndim != 2 or n == "inp.weight"]
    ropts = [torch.optim.Muon(mats, lr=LR, weight_decay=0.1),
             torch.optim.AdamW(rest, lr=LR, betas=(0.9, 0.95), weight_decay=0.0, foreach=False)]
    for step in range(2):
        x, y = batch(step, 0, 1, N)
        nn.functional.mse_loss(net(x), y).backward()
        opt.step()
        opt.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()
        for o in ropts:
            o.step()
            o.zero_grad()
    assert_params(merge([gather_params(net)], SHAPES), ref, 0, exact=True)
    with pytest.raises(ValueError, match=r"^muon_filter accepted parameter 'blocks.0.norm.weight' of shape \(6,\); Muon only"):
        ragfsdp.optim.Muon(net, muon_filter=lambda n, s: True)


def test_export_dcp_of_muon_loads_into_torch_muon_and_adamw(ranks):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    from ragckpt.convert.dcp import export_dcp

    res, tmp = ranks
    export_dcp(str(tmp / "ck_muon"), str(tmp / "dcp_muon"))
    net = make_net(seed=3)
    opts = torch_opts("muon", net, lr=0.5)
    nn.functional.mse_loss(net(batch(0, 0, 1, N)[0]), batch(0, 0, 1, N)[1]).backward()
    for o in opts:
        o.step()  # so the optimizers have state to fill
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    msd, osd = get_state_dict(net, tuple(opts), options=flat)
    target = {"model": msd, "optim": osd}
    dcp.load(target, checkpoint_id=str(tmp / "dcp_muon"))
    set_state_dict(net, tuple(opts), model_state_dict=target["model"], optim_state_dict=target["optim"], options=flat)
    saved = merged_state([r[("saved", "muon")] for r in res[:2]])
    names = {id(p): n for n, p in net.named_parameters()}
    keys = set()
    for o in opts:
        for p, st in o.state.items():
            for k, v in st.items():
                keys.add(k)
                assert torch.equal(v, saved[f"optim.state.{names[id(p)]}.{k}"]), (names[id(p)], k)
    assert keys == {"momentum_buffer", "exp_avg", "exp_avg_sq", "step"}
    assert [o.param_groups[0]["lr"] for o in opts] == [LR, LR]


# -- AdamW's fast paths: chunks, fused kernel, lazy moments -------------------------------------------
WIDE = {"d": 40, "h": 101}  # tensors of hundreds to thousands of elements: vector loops and their tails


def run_pair(net: nn.Module, ref: nn.Module, opt: object, ropt: torch.optim.Optimizer, steps: int = 3) -> None:
    for step in range(steps):
        x, y = batch(step, 0, 1, N)
        for m, o in ((net, opt), (ref, ropt)):
            nn.functional.mse_loss(m(x), y).backward()
            o.step()
            o.zero_grad()


def assert_state_equal(opt: ragfsdp.optim.FlatOptimizer, ref: nn.Module, ropt: torch.optim.Optimizer,
                       shapes: dict[str, tuple]) -> None:
    got = {}
    for name, pcs in state_pieces(opt, 0).items():
        param = name.removeprefix("optim.state.").rsplit(".", 1)[0]
        got[name] = merge([{name: pcs}], {name: () if name.endswith(".step") else shapes[param]})[name]
    for k, v in torch_state(ref, [ropt]).items():
        assert torch.equal(got[k], v), k


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("variant", ["plain", "maximize", "groups_and_frozen"])
def test_adamw_chunked_update_is_bit_identical_to_torch(monkeypatch, variant, threads):
    """Chunks of 7 elements (CHUNK is 2**18 otherwise, more than these shards): cuts anywhere in a
    parameter, the scratch reused across pieces and groups, `maximize`'s -grad in the scratch too."""
    import ragfsdp.optim.adamw as adamw_mod

    monkeypatch.setattr(adamw_mod, "CHUNK", 7)
    torch.set_num_threads(threads)
    net, ref = make_net(**WIDE), make_net(**WIDE)
    shapes = {n: tuple(p.shape) for n, p in ref.named_parameters()}
    net = shard(net, "adamw", None, None)
    kw = {"lr": LR, "weight_decay": 0.1, "maximize": variant == "maximize"}
    opt = ragfsdp.optim.AdamW(net, **kw)
    if variant == "groups_and_frozen":  # runs of pieces: no decay for the biases, one frozen weight
        biases = [n for n in opt.param_names if n.endswith("bias")]
        opt.param_groups = [dict(opt.param_groups[0], params=[n for n in opt.param_names if n not in biases]),
                            dict(opt.param_groups[0], params=biases, weight_decay=0.0)]
        net.blocks[0].up.weight.requires_grad_(False)
        ref.blocks[0].up.weight.requires_grad_(False)
        rbias = [p for n, p in ref.named_parameters() if n.endswith("bias")]
        rrest = [p for n, p in ref.named_parameters() if not n.endswith("bias")]
        ropt = torch.optim.AdamW([{"params": rrest}, {"params": rbias, "weight_decay": 0.0}], lr=LR,
                                 weight_decay=0.1, foreach=False)
    else:
        ropt = torch.optim.AdamW(ref.parameters(), foreach=False, **kw)
    run_pair(net, ref, opt, ropt)
    assert_params(merge([gather_params(net)], shapes), ref, 0, exact=True)
    assert_state_equal(opt, ref, ropt, shapes)
    assert padding_zero(opt)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("maximize", [False, True])
def test_adamw_fused_is_bit_identical_to_torch_fused(maximize, threads):
    torch.set_num_threads(threads)
    net, ref = make_net(**WIDE), make_net(**WIDE)
    shapes = {n: tuple(p.shape) for n, p in ref.named_parameters()}
    net = shard(net, "adamw", None, None)
    opt = ragfsdp.optim.AdamW(net, lr=LR, weight_decay=0.1, maximize=maximize, fused=True)
    ropt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.1, maximize=maximize, fused=True)
    run_pair(net, ref, opt, ropt)
    assert_params(merge([gather_params(net)], shapes), ref, 0, exact=True)
    assert_state_equal(opt, ref, ropt, shapes)
    assert padding_zero(opt)


def test_adamw_moments_are_allocated_at_the_first_step_and_a_checkpoint_before_it_loads(tmp_path):
    net = shard(make_net(), "adamw", None, None)
    opt = make_opt("adamw", net)
    assert opt._moments == [None] * len(opt.groups)  # nothing allocated at construction
    nn.functional.mse_loss(net(batch(0, 0, 1, N)[0]), batch(0, 0, 1, N)[1]).backward()
    net2 = shard(make_net(), "adamw", None, None)
    opt2 = make_opt("adamw", net2)
    st = ragfsdp.state(net2, opt2)  # before any step: zero moments (what the first step starts from)
    assert all(sb.local.count_nonzero() == 0 for sb in opt2.state_buffers())
    url = str(tmp_path / "ck")
    ragckpt.commit(url, rank_manifests=[ragckpt.save_shard(url, **st)])
    net3 = shard(make_net(seed=7), "adamw", None, None)
    opt3 = make_opt("adamw", net3)
    ragfsdp.load_state(net3, opt3, url)
    assert opt3.steps.tolist() == [0.0] * len(SHAPES)
    ref = make_net()
    ropt = torch_opts("adamw", ref)[0]
    run_pair(net3, ref, opt3, ropt, steps=2)
    assert_params(merge([gather_params(net3)], SHAPES), ref, 0, exact=True)
    opt.step()  # the first step allocates the moments
    assert all(m is not None for m in opt._moments)
    ragfsdp.load_state(net, opt, url)  # loaded zeros: a fresh start again
    assert opt.steps.tolist() == [0.0] * len(SHAPES)
    assert all(sb.local.count_nonzero() == 0 for sb in opt.state_buffers())

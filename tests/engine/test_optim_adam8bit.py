"""8-bit Adam: the block-wise quantiser against a dense nearest-code search, and Adam8bit at 1-4
gloo ranks against an independent single-process reference of the same math."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import ragckpt
import ragfsdp
from ragfsdp.optim import adam8bit
from ragfsdp.optim import blockwise_quant as bq
from ragfsdp.optim.adam8bit import Adam8bit
from tests.engine.dist_helpers import run_ranks


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The in-process runs take one core, as the forked ranks do (threads fight over shared cores)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _block_absmax(x64: torch.Tensor, block: int) -> torch.Tensor:
    padded = torch.zeros(-(-x64.numel() // block) * block, dtype=x64.dtype)
    padded[:x64.numel()] = x64.abs()
    return padded.view(-1, block).amax(dim=1)


def nearest_codes(x: torch.Tensor, block: int, qmap: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference quantiser: per block of `block` elements from element 0, scale by the absmax in
    float64 and take the nearest map value by a dense search over all 256 (ties to the lower code)."""
    x64 = x.double().reshape(-1)
    amax = _block_absmax(x64, block)
    per_elem = amax.repeat_interleave(block)[:x64.numel()]
    scaled = x64 / torch.where(per_elem > 0, per_elem, 1.0)
    dist = (scaled[:, None] - qmap.double()[None, :]).abs()
    return dist.argmin(dim=1).to(torch.uint8), amax.float()  # argmin: the first of equal distances


def step_bound(x: torch.Tensor, block: int, qmap: torch.Tensor) -> torch.Tensor:
    """Per element, how far the nearest map value can be: half the gap between the map values around
    the scaled value (or the distance to the end value for a scaled value beyond it), times absmax."""
    x64 = x.double().reshape(-1)
    out = torch.empty_like(x64)
    m = qmap.double()
    for s in range(0, x64.numel(), block):
        chunk = x64[s:s + block]
        a = chunk.abs().max().item()
        scaled = chunk / (a or 1.0)
        hi = torch.searchsorted(m, scaled).clamp(max=255)
        lo = (hi - 1).clamp(min=0)
        gap = torch.where((scaled >= m[0]) & (scaled <= m[-1]), (m[hi] - m[lo]) / 2,
                          torch.minimum((scaled - m[0]).abs(), (scaled - m[-1]).abs()))
        out[s:s + block] = gap * a
    return out


def test_dynamic_maps():
    for signed in (True, False):
        m = bq.dynamic_map(signed)
        assert m.shape == (256,) and m.dtype == torch.float32
        assert bool((m[1:] > m[:-1]).all()) and m[-1] == 1.0 and 0.0 in m.tolist()
    s, u = bq.dynamic_map(True), bq.dynamic_map(False)
    assert s.min() == -s[-2] and (s < 0).sum() == 127  # symmetric but for 1.0
    assert u.min() == 0.0
    # bitsandbytes' map: the smallest magnitudes are the first decade's midpoints
    assert s[128].item() == pytest.approx(0.55e-6) and u[1].item() == pytest.approx(0.325e-6)


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("numel", [256 * 7, 256 * 5 + 77, 100])
def test_quantize_matches_dense_search(signed, numel):
    g = torch.Generator().manual_seed(numel + signed)
    # moments span orders of magnitude: log-uniform magnitudes
    x = torch.exp(torch.empty(numel).uniform_(-14, 2, generator=g))
    if signed:
        x = x * torch.sign(torch.randn(numel, generator=g))
    qmap = bq.dynamic_map(signed)
    blocks = bq.Blocks.of_tensor(numel)
    codes, amax = bq.quantize(x, blocks, signed)
    want_codes, want_amax = nearest_codes(x, 256, qmap)
    assert codes.dtype == torch.uint8 and torch.equal(codes, want_codes)
    assert torch.equal(amax, want_amax)
    back = bq.dequantize(codes, amax, blocks, signed)
    err = (back.double() - x.double()).abs()
    bound = step_bound(x, 256, qmap)
    # plus the float32 rounding of map value x absmax
    assert bool((err <= bound + x.double().abs() * 2.0 ** -23).all()), float((err - bound).max())


def test_zero_constant_and_huge_blocks():
    zero = torch.zeros(256)
    const = torch.full((256,), -3.5)
    huge = torch.randn(256, generator=torch.Generator().manual_seed(1)) * 1e-3
    huge[17] = 1e30
    x = torch.cat([zero, const, huge, torch.full((10,), 2.0)])
    blocks = bq.Blocks.of_tensor(x.numel())
    codes, amax = bq.quantize(x, blocks, True)
    assert torch.equal(amax, torch.tensor([0.0, 3.5, 1e30, 2.0]))
    back = bq.dequantize(codes, amax, blocks, True)
    assert bool(torch.isfinite(back).all())
    assert torch.equal(back[:256], zero)  # zeros come back exactly (0 is a map value)
    want_codes, _ = nearest_codes(x, 256, bq.dynamic_map(True))
    assert torch.equal(codes, want_codes)
    # -1 is not in the signed map: its nearest value is the most negative one
    assert torch.allclose(back[256:512], torch.full((256,), -3.5 * 0.99296875))
    assert back[512 + 17] == 1e30 and torch.equal(back[-10:], torch.full((10,), 2.0))
    # beside 1e30 every other value is below the map's smallest step: 0
    assert int((back[512:768] != 0).sum()) == 1


@pytest.mark.parametrize("signed", [True, False])
def test_a_value_on_a_midpoint_takes_the_lower_code(signed):
    qmap = bq.dynamic_map(signed)
    zero = int((qmap == 0).nonzero())
    # half the smallest positive map value is exact in float32 and exactly between it and 0
    x = torch.tensor([1.0, qmap[zero + 1].item() / 2, -qmap[zero + 1].item() / 2 if signed else 0.0])
    codes, _ = bq.quantize(x, bq.Blocks.of_tensor(3), signed)
    assert codes.tolist() == [255, zero, zero - 1 if signed else zero]
    assert torch.equal(codes, nearest_codes(x, 256, qmap)[0])


def test_gaps_are_skipped_and_left_zero():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(256 + 5 + 256 + 100 + 3, generator=g)
    x[256:261] = 1e6  # a gap with huge values must not reach any block's absmax
    blocks = bq.Blocks(torch.tensor([256, 5, 256, 100, 3]), torch.tensor([True, False, True, True, False]))
    codes, amax = bq.quantize(x, blocks, True)
    keep = torch.cat([torch.arange(0, 256), torch.arange(261, 261 + 356)])
    want_codes, want_amax = nearest_codes(torch.cat([x[:256], x[261:517], x[517:617]]), 256, bq.dynamic_map(True))
    # blocks of 256, 256 and 100: the reference's blocks of the kept elements are the same
    assert torch.equal(codes[keep], want_codes) and torch.equal(amax, want_amax)
    assert bool((codes[256:261] == 0).all()) and bool((codes[-3:] == 0).all())
    back = bq.dequantize(codes, amax, blocks, True)
    assert bool((back[256:261] == 0).all()) and bool((back[-3:] == 0).all())


def test_bad_input_is_named():
    blocks = bq.Blocks.of_tensor(300)
    with pytest.raises(ValueError, match="x has 10 elements"):
        bq.quantize(torch.zeros(10), blocks, True)
    with pytest.raises(ValueError, match="codes must be uint8"):
        bq.dequantize(torch.zeros(300), torch.zeros(2), blocks, True)
    with pytest.raises(ValueError, match="amax has 1 values"):
        bq.dequantize(torch.zeros(300, dtype=torch.uint8), torch.zeros(1), blocks, True)


# -- Adam8bit on a sharded model ---------------------------------------------------------------------

LR, BETAS, EPS, WD = 3e-3, (0.9, 0.99), 1e-8, 0.01
STEPS, SAVE_AFTER = 5, 3


class Body(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(100, 130, bias=False)  # 13,000: quantised, cut at 6,400 (lcm of 256 and a row)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.gelu(self.up(x))


class Net8(nn.Module):
    """Tensors on both sides of 4096 elements, rows (70, 100, 130, 64) that do not divide 256, 130 and
    75 rows that 2, 3 and 4 ranks do not divide, and a 1-D-blocked 75x64 weight with a short last block."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(70, 100)   # 7,000 quantised (whole: lcm(256, 70) > 7,000) + 100 float32
        self.body = Body()
        self.down = nn.Linear(130, 64)  # 8,320 quantised, whole
        self.mid = nn.Linear(64, 75)    # 4,800 quantised in blocks of 4 rows, last block 192
        self.head = nn.Linear(75, 5)    # 375 float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.body(nn.functional.gelu(self.inp(x)))
        return self.head(nn.functional.gelu(self.mid(nn.functional.gelu(self.down(x)))))


def make_net8(seed: int = 0) -> Net8:
    torch.manual_seed(seed)
    return Net8()


def batch8(step: int, rank: int, world: int, n: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    x, y = torch.randn(n, 70, generator=g), torch.randn(n, 5, generator=g)
    k = n // world
    return x[rank * k:(rank + 1) * k], y[rank * k:(rank + 1) * k]


def shard8(net: nn.Module, mp: bool = False, granularity: object = Adam8bit.granularity) -> None:
    policy = ragfsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mp else None
    ragfsdp.fully_shard(net.body, granularity=granularity, mp_policy=policy)
    ragfsdp.fully_shard(net, granularity=granularity, mp_policy=policy)


def pieces_of(net: nn.Module) -> dict:
    out: dict = {}
    for g in ragfsdp.flat_groups(net):
        for pc in g.pieces():
            out.setdefault(pc.name, []).append((pc.flat_start, g.shard[pc.offset:pc.offset + pc.length].clone()))
    return out


def merge_pieces(per_rank: list[dict], shapes: dict) -> dict[str, torch.Tensor]:
    out = {}
    for name, shape in shapes.items():
        flat = torch.full((math.prod(shape),), float("nan"))
        for pcs in per_rank:
            for start, vals in pcs.get(name, []):
                flat[start:start + vals.numel()] = vals
        out[name] = flat.view(shape)
    return out


def barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def save(net: nn.Module, opt: Adam8bit, url: str, rank: int) -> None:
    ragckpt.save_shard(url, **ragfsdp.state(net, opt), save_id="adam8bit")
    barrier()
    if rank == 0:
        ragckpt.commit(url)
    barrier()


def train8(rank: int, world: int, steps: range, mp: bool = False, save_url: str | None = None,
           load_url: str | None = None, resave_url: str | None = None, frozen: str | None = None) -> dict:
    """Steps of Adam8bit on Net8 at `world` ranks: losses (the global batch's mean), parameters
    (this rank's pieces); optionally loaded from `load_url` first (and saved again to `resave_url`)
    and saved to `save_url` after step SAVE_AFTER - 1."""
    net = make_net8(seed=0 if load_url is None else 77)
    if frozen is not None:
        net.get_parameter(frozen).requires_grad_(False)
    shard8(net, mp)
    opt = Adam8bit(net, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    if load_url is not None:
        ragfsdp.load_state(net, opt, load_url)
        if resave_url is not None:
            save(net, opt, resave_url, rank)
    losses = []
    for step in steps:
        x, y = batch8(step, rank, world)
        loss = nn.functional.mse_loss(net(x).float(), y)
        loss.backward()
        total = torch.tensor([loss.item()])
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(total)
        losses.append(total.item() / world)
        opt.step()
        opt.zero_grad()
        if save_url is not None and step == SAVE_AFTER - 1:
            save(net, opt, save_url, rank)
    return {"losses": losses, "params": pieces_of(net)}


def run_at(fn, world: int, tmp_path, *args) -> list:
    """`run_ranks`, or in this process at one rank (no process group: the engine's one-rank path)."""
    if world == 1:
        return [fn(0, 1, *args)]
    return run_ranks(fn, world, tmp_path, *args)


# the independent single-process reference: plain tensors, one set of blocks per whole tensor

def ref_quantize(x: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return nearest_codes(x, 256, bq.dynamic_map(signed))


def ref_dequantize(codes: torch.Tensor, amax: torch.Tensor, signed: bool) -> torch.Tensor:
    per_elem = amax.repeat_interleave(256)[:codes.numel()]
    return bq.dynamic_map(signed)[codes.long()] * per_elem


def ref_adam8bit_step(p: torch.Tensor, g: torch.Tensor, state: dict, step: int) -> None:
    """One AdamW step of one parameter in place: 8-bit moments (dequantise, update, requantise)
    for >= 4096 elements, float32 moments below."""
    flat_p, flat_g = p.data.view(-1), g.reshape(-1).float()
    quantised = flat_p.numel() >= 4096
    if not state:
        zeros = torch.zeros_like(flat_p)
        state.update(m=ref_quantize(zeros, True), v=ref_quantize(zeros, False)) if quantised else \
            state.update(m=zeros.clone(), v=zeros.clone())
    m = ref_dequantize(*state["m"], True) if quantised else state["m"]
    v = ref_dequantize(*state["v"], False) if quantised else state["v"]
    flat_p.mul_(1 - LR * WD)
    m.lerp_(flat_g, 1 - BETAS[0])
    v.mul_(BETAS[1]).addcmul_(flat_g, flat_g, value=1 - BETAS[1])
    denom = (v.sqrt() / (1 - BETAS[1] ** step) ** 0.5).add_(EPS)
    flat_p.addcdiv_(m, denom, value=-LR / (1 - BETAS[0] ** step))
    if quantised:
        state["m"], state["v"] = ref_quantize(m, True), ref_quantize(v, False)


_REF: dict = {}


def reference(world: int, mp: bool, frozen: str | None = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses and parameters of STEPS single-process steps on the global batch of `world` ranks."""
    if (world, mp, frozen) in _REF:
        return _REF[(world, mp, frozen)]
    net = make_net8()
    if frozen is not None:
        net.get_parameter(frozen).requires_grad_(False)
    states: dict = {n: {} for n, _ in net.named_parameters()}
    losses = []
    for step in range(STEPS):
        x, y = batch8(step, 0, 1, n=12 // world * world)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mp):
            out = net(x)
        loss = nn.functional.mse_loss(out.float(), y)
        loss.backward()
        losses.append(loss.item())
        with torch.no_grad():
            for n, p in net.named_parameters():
                if p.requires_grad:
                    ref_adam8bit_step(p, p.grad, states[n], step + 1)
                p.grad = None
    _REF[(world, mp, frozen)] = losses, {n: p.detach().clone() for n, p in net.named_parameters()}
    return _REF[(world, mp, frozen)]


_RUNS: dict = {}


def run_w2_with_save(tmp_path_factory) -> tuple[list, str]:
    """The W=2 run, saved after SAVE_AFTER steps: shared by the parity and the checkpoint tests."""
    if "w2" not in _RUNS:
        tmp = tmp_path_factory.mktemp("w2")
        url = str(tmp / "ck_w2")
        _RUNS["w2"] = run_ranks(train8, 2, tmp, range(STEPS), False, url), url
    return _RUNS["w2"]


def check_against_reference(res: list, world: int, mp: bool, frozen: str | None = None) -> None:
    """At one rank: bit for bit (same arithmetic on the same gradients). At more, gradients differ
    in rounding (split batch, reduce-scatter sums), so a few moments land on the other side of a
    code midpoint; the parameters must still agree almost everywhere, far within what they moved."""
    losses, params = reference(world, mp, frozen)
    shapes = {n: tuple(p.shape) for n, p in params.items()}
    got = merge_pieces([r["params"] for r in res], shapes)
    if world == 1:
        assert res[0]["losses"] == losses
        for n, p in params.items():
            assert torch.equal(got[n], p), n
        return
    assert res[0]["losses"] == pytest.approx(losses, rel=1e-3 if mp else 1e-5)
    init = dict(make_net8().named_parameters())
    diff = torch.cat([(got[n] - p).abs().reshape(-1) for n, p in params.items()])
    moved = torch.cat([(p - init[n].detach()).abs().reshape(-1) for n, p in params.items()])
    assert not diff.isnan().any()  # every element came back from some rank
    # measured: 1.3% under bf16 (its gradients' rounding), 5e-6 in float32
    assert diff.mean() < (0.05 if mp else 1e-4) * moved.mean(), (diff.mean(), moved.mean())
    if not mp:  # measured: 0.02% of the elements, each a moment's code flipped at a midpoint
        assert (diff > 1e-5).float().mean() < 0.005


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_matches_single_process_reference(world, tmp_path, tmp_path_factory):
    if world == 2:
        res, _ = run_w2_with_save(tmp_path_factory)
    else:
        res = run_at(train8, world, tmp_path, range(STEPS))
    check_against_reference(res, world, False)


@pytest.mark.parametrize("world", [1, 3])
def test_mixed_precision_matches_reference(world, tmp_path):
    res = run_at(train8, world, tmp_path, range(STEPS), True)
    check_against_reference(res, world, True)


@pytest.mark.parametrize("frozen", ["inp.weight", "down.weight", "head.bias"])
def test_frozen_parameter_is_left_alone(frozen, tmp_path):
    """A frozen parameter splits its group's update into the pieces of the others (a partial pass
    that must keep the frozen tensor's codes and values)."""
    res = run_at(train8, 1, tmp_path, range(STEPS), False, None, None, None, frozen)
    check_against_reference(res, 1, False, frozen)
    got = merge_pieces([res[0]["params"]], {frozen: tuple(make_net8().get_parameter(frozen).shape)})
    assert torch.equal(got[frozen], make_net8().get_parameter(frozen).detach())


def test_chunked_update_is_the_same(tmp_path, monkeypatch):
    """Shards are updated CHUNK elements at a time (bounded temporaries): chunks of a few blocks,
    cut anywhere between segments, give the same bits as one pass."""
    monkeypatch.setattr(adam8bit, "CHUNK", 1000)
    res = run_at(train8, 1, tmp_path, range(STEPS))
    check_against_reference(res, 1, False)


def test_bad_hyperparameters_are_named():
    net = make_net8()
    shard8(net)
    for kw, word in (({"lr": -1.0}, "lr"), ({"betas": (0.9, 1.0)}, "betas"), ({"eps": -1e-8}, "eps"),
                     ({"weight_decay": -0.1}, "weight_decay")):
        with pytest.raises(ValueError, match=f"^{word} must be"):
            Adam8bit(net, **kw)


def read_all(url: str) -> dict[str, torch.Tensor]:
    ck = ragckpt.open(url)
    return {n: ck.read(n) for n in ck.names()}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def test_checkpoint_is_the_same_at_any_world_size(tmp_path, tmp_path_factory):
    w2, url2 = run_w2_with_save(tmp_path_factory)
    url3, url1 = str(tmp_path / "ck_w3"), str(tmp_path / "ck_w1")
    w3 = run_ranks(train8, 3, tmp_path, range(SAVE_AFTER, STEPS), False, None, url2, url3)
    run_at(train8, 1, tmp_path, range(0), False, None, url2, url1)
    a, b, c = read_all(url2), read_all(url3), read_all(url1)
    assert sorted(a) == sorted(b) == sorted(c)
    p = "optim.state.body.up.weight."
    assert a[p + "exp_avg_q"].dtype == torch.uint8 and a[p + "exp_avg_q"].shape == (130, 100)
    assert a[p + "exp_avg_sq_absmax"].shape == (51,) and a["optim.state.head.weight.exp_avg"].dtype == torch.float32
    assert "optim.state.head.weight.exp_avg_q" not in a and "optim.state.mid.weight.exp_avg" not in a
    assert a[p + "step"].item() == SAVE_AFTER
    for n in a:
        assert a[n].dtype == b[n].dtype == c[n].dtype, n
        assert torch.equal(_bits(a[n]), _bits(b[n])) and torch.equal(_bits(a[n]), _bits(c[n])), n
    # continuing at W=3 from the reload follows the W=2 run that never stopped
    assert w3[0]["losses"] == pytest.approx(w2[0]["losses"][SAVE_AFTER:], rel=1e-5)
    shapes = {n: tuple(t.shape) for n, t in make_net8().named_parameters()}
    got3, got2 = merge_pieces([r["params"] for r in w3], shapes), merge_pieces([r["params"] for r in w2], shapes)
    for n in shapes:
        torch.testing.assert_close(got3[n], got2[n], atol=1e-3, rtol=0)
    diff = torch.cat([(got3[n] - got2[n]).abs().reshape(-1) for n in shapes])
    assert (diff > 1e-5).float().mean() < 0.005


def refuse_split_blocks(rank: int, world: int) -> str:
    net = make_net8()
    shard8(net, granularity=None)  # whole rows: body.up (130 rows of 100) is cut at row edges
    with pytest.raises(ValueError) as err:
        Adam8bit(net)
    return str(err.value)


def test_refuses_a_layout_that_splits_a_block(tmp_path):
    msgs = run_ranks(refuse_split_blocks, 2, tmp_path)
    assert msgs[0] == msgs[1]  # every rank refuses alike (no rank left waiting in a collective)
    assert "'body.up.weight'" in msgs[0] and "granularity=ragfsdp.optim.Adam8bit.granularity" in msgs[0]
    assert "\n" not in msgs[0]


def test_granularity_policy():
    assert Adam8bit.granularity("w", (100, 70)) == math.lcm(256, 70)
    assert Adam8bit.granularity("w", (75, 64)) == 256 and Adam8bit.granularity("b", (5000,)) == 256
    assert Adam8bit.granularity("b", (4095,)) == "row" and Adam8bit.granularity("s", ()) == "row"


def test_tracks_torch_adamw():
    """20 steps on one process: the 8-bit moments cost little against float32 AdamW."""
    losses = {}
    for kind in ("adam8bit", "adamw"):
        net = make_net8(seed=5)
        if kind == "adam8bit":
            shard8(net)
            opt = Adam8bit(net, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
        else:
            opt = torch.optim.AdamW(net.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
        x, y = batch8(0, 0, 1, n=48)
        losses[kind] = []
        for _ in range(20):
            loss = nn.functional.mse_loss(net(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[kind].append(loss.item())
    q, f = torch.tensor(losses["adam8bit"]), torch.tensor(losses["adamw"])
    assert f[-1] < 0.5 * f[0]  # the problem is being learned
    gap = ((q - f).abs() / f).max().item()
    assert gap < 0.01, f"8-bit Adam's loss is {gap:.2%} from AdamW's"


class Vectors(nn.Module):
    """At 4 ranks the planner puts a and b (17 blocks each, the last of one element) on rank 0, 34
    blocks in a shard of 33 blocks' elements, and c over ranks 1-3: no one absmax FlatLayout holds
    both, so c's absmax needs a buffer of its own."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(9)
        self.a = nn.Parameter(torch.randn(4097, generator=g))
        self.b = nn.Parameter(torch.randn(4097, generator=g))
        self.c = nn.Parameter(torch.randn(99, 256, generator=g))

    def forward(self, w: dict[str, torch.Tensor]) -> torch.Tensor:
        return sum(((getattr(self, n) * w[n]).sum() for n in ("a", "b", "c")), torch.zeros(()))


def vector_weights(step: int) -> dict[str, torch.Tensor]:
    """Gradients in eighths: every rank's sum of them (and the division by 4) is exact."""
    g = torch.Generator().manual_seed(40 + step)
    return {n: torch.randint(-16, 17, shape, generator=g).float() / 8
            for n, shape in (("a", (4097,)), ("b", (4097,)), ("c", (99, 256)))}


def train_vectors(rank: int, world: int, url: str) -> dict:
    net = Vectors()
    ragfsdp.fully_shard(net, granularity=Adam8bit.granularity)
    (group,) = ragfsdp.flat_groups(net)
    opt = Adam8bit(net, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    for step in range(3):
        net(vector_weights(step)).backward()
        opt.step()
        opt.zero_grad()
    if world > 1:
        save(net, opt, url, rank)
    absmax = [sb for sb in opt.checkpoint_buffers() if "absmax" in sb.name]
    return {"params": pieces_of(net), "shard_size": group.layout.shard_size,
            "absmax": [(sb.name, sb.tensors) for sb in absmax]}


def test_tensor_over_three_ranks_beside_short_blocks(tmp_path):
    url = str(tmp_path / "ck_vectors")
    res = run_ranks(train_vectors, 4, tmp_path, url)
    assert res[0]["shard_size"] == 33 * 256  # the layout this test is about
    assert [t for _, t in res[0]["absmax"]] == [("optim.state.a.exp_avg_absmax", "optim.state.b.exp_avg_absmax"),
                                                ("optim.state.c.exp_avg_absmax",),
                                                ("optim.state.a.exp_avg_sq_absmax", "optim.state.b.exp_avg_sq_absmax"),
                                                ("optim.state.c.exp_avg_sq_absmax",)]
    ref = Vectors()
    states: dict = {n: {} for n in ("a", "b", "c")}
    with torch.no_grad():
        for step in range(3):
            w = vector_weights(step)
            for n, p in ref.named_parameters():
                ref_adam8bit_step(p, w[n], states[n], step + 1)
    got = merge_pieces([r["params"] for r in res], {n: tuple(p.shape) for n, p in ref.named_parameters()})
    for n, p in ref.named_parameters():
        assert torch.equal(got[n], p.detach()), n  # exact gradients: the same bits as the reference
    saved = read_all(url)
    for n in ("a", "b", "c"):
        assert torch.equal(saved[f"optim.state.{n}.exp_avg_q"].reshape(-1), states[n]["m"][0]), n
        assert torch.equal(saved[f"optim.state.{n}.exp_avg_absmax"], states[n]["m"][1]), n
        assert torch.equal(saved[f"optim.state.{n}.exp_avg_sq_q"].reshape(-1), states[n]["v"][0]), n
        assert torch.equal(saved[f"optim.state.{n}.exp_avg_sq_absmax"], states[n]["v"][1]), n


# tiny-llama's parameters (ragfsdp.models "tiny-llama": vocabulary 256, width 64, MLP 128, 2 layers,
# 4 heads of which 2 key/value), names and order as transformers registers them, sharded as
# ragfsdp.train shards it (each layer a unit, then the root), with a loss linear in the parameters
LLAMA_LAYER = (("self_attn.q_proj.weight", (64, 64)), ("self_attn.k_proj.weight", (32, 64)),
               ("self_attn.v_proj.weight", (32, 64)), ("self_attn.o_proj.weight", (64, 64)),
               ("mlp.gate_proj.weight", (128, 64)), ("mlp.up_proj.weight", (128, 64)),
               ("mlp.down_proj.weight", (64, 128)), ("input_layernorm.weight", (64,)),
               ("post_attention_layernorm.weight", (64,)))


class _Holder(nn.Module):
    def __init__(self, params: tuple[tuple[str, tuple[int, ...]], ...], g: torch.Generator) -> None:
        super().__init__()
        for dotted, shape in params:
            *path, leaf = dotted.split(".")
            mod = self
            for part in path:
                if not hasattr(mod, part):
                    mod.add_module(part, nn.Module())
                mod = getattr(mod, part)
            mod.register_parameter(leaf, nn.Parameter(torch.randn(shape, generator=g) / 8))

    def forward(self, w: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
        # called, so that a unit's pre-forward hook gathers its parameters
        return sum(((p * w[prefix + n]).sum() for n, p in self.named_parameters()), torch.zeros(()))


class LlamaShapes(nn.Module):
    """At 2 ranks a layer's q/o/gate/up/down share one absmax buffer with gate cut between the
    ranks (its first part at the end of rank 0's absmax, after a gap), k/v and the norms keep
    float32 moments between quantised tensors; at 3 ranks embeddings and head each cross a rank
    boundary; at 5 ranks each spans three ranks (absmax buffers of their own, the second '.1')."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(11)
        self.model = nn.Module()
        self.model.add_module("embed_tokens", _Holder((("weight", (256, 64)),), g))
        self.model.add_module("layers", nn.ModuleList([_Holder(LLAMA_LAYER, g) for _ in range(2)]))
        self.model.add_module("norm", _Holder((("weight", (64,)),), g))
        self.add_module("lm_head", _Holder((("weight", (256, 64)),), g))

    def forward(self, w: dict[str, torch.Tensor]) -> torch.Tensor:
        parts = [self.model.embed_tokens(w, "model.embed_tokens.")]
        parts += [layer(w, f"model.layers.{i}.") for i, layer in enumerate(self.model.layers)]
        parts += [self.model.norm(w, "model.norm."), self.lm_head(w, "lm_head.")]
        return sum(parts, torch.zeros(()))


def llama_weights(step: int) -> dict[str, torch.Tensor]:
    """Gradients in eighths (exact at any world size, see vector_weights), of growing size so that
    the blocks' absmax differ from block to block and from tensor to tensor."""
    g = torch.Generator().manual_seed(70 + step)
    out = {}
    for i, (n, p) in enumerate(LlamaShapes().named_parameters()):
        scale = torch.arange(p.numel(), dtype=torch.float32).div_(256, rounding_mode="floor").add_(i + 1)
        out[n] = (torch.randint(-8, 9, (p.numel(),), generator=g).float() * scale).div_(8).view(p.shape)
    return out


LLAMA_STEPS = 3


def train_llama_shapes(rank: int, world: int, urls: dict[str, str]) -> list[str]:
    """Without `load`: LLAMA_STEPS steps, saved to `saved`, then one more saved to `after`. With it:
    the checkpoint loaded and saved again to `resaved`, then the one more step saved to `after`.
    Returns the names of the absmax buffers."""
    net = LlamaShapes()
    for layer in net.model.layers:
        ragfsdp.fully_shard(layer, granularity=Adam8bit.granularity)
    ragfsdp.fully_shard(net, granularity=Adam8bit.granularity)
    opt = Adam8bit(net, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    if "load" in urls:
        ragfsdp.load_state(net, opt, urls["load"])
        save(net, opt, urls["resaved"], rank)
    steps = range(LLAMA_STEPS, LLAMA_STEPS + 1) if "load" in urls else range(LLAMA_STEPS + 1)
    for step in steps:
        net(llama_weights(step)).backward()
        opt.step()
        opt.zero_grad()
        if step == LLAMA_STEPS - 1:
            save(net, opt, urls["saved"], rank)
    save(net, opt, urls["after"], rank)
    return [sb.name for sb in opt.checkpoint_buffers() if "absmax" in sb.name]


def test_llama_shapes_checkpoint_reloads_at_any_world_size(tmp_path):
    """With exact gradients a 1-rank and a 2-rank run save the same bits, every tensor (absmax
    included, read by name: element i is block i's absmax) the single-process reference's, and a
    reload of the 2-rank save at 1, 3 and 5 ranks saves the same bits again and steps on to the
    bits of the run that never stopped."""
    one = {k: str(tmp_path / f"one_{k}") for k in ("saved", "after")}
    run_at(train_llama_shapes, 1, tmp_path, one)  # in this process first: the forks start warm
    urls = {k: str(tmp_path / f"w2_{k}") for k in ("saved", "after")}
    run_ranks(train_llama_shapes, 2, tmp_path, urls)
    saved, after = read_all(urls["saved"]), read_all(urls["after"])
    for url, want in ((one["saved"], saved), (one["after"], after)):
        got = read_all(url)
        assert sorted(got) == sorted(want)
        for n in want:
            assert torch.equal(_bits(got[n]), _bits(want[n])), (url, n)
    ref = LlamaShapes()
    states: dict = {n: {} for n, _ in ref.named_parameters()}
    with torch.no_grad():
        for step in range(LLAMA_STEPS):
            w = llama_weights(step)
            for n, p in ref.named_parameters():
                ref_adam8bit_step(p, w[n], states[n], step + 1)
    absmax_names = 0
    for n, p in ref.named_parameters():
        assert torch.equal(saved[n], p.detach()), n
        st, q = states[n], f"optim.state.{n}."
        if p.numel() >= Adam8bit.MIN_NUMEL:
            for key, (codes, amax) in (("exp_avg", st["m"]), ("exp_avg_sq", st["v"])):
                assert torch.equal(saved[q + key + "_q"].reshape(-1), codes), n
                assert saved[q + key + "_absmax"].shape == (-(-p.numel() // 256),), n
                assert torch.equal(saved[q + key + "_absmax"], amax), f"{n}: {key}_absmax not in block order"
                absmax_names += 1
        else:
            assert torch.equal(saved[q + "exp_avg"].reshape(-1), st["m"]), n
            assert torch.equal(saved[q + "exp_avg_sq"].reshape(-1), st["v"]), n
    assert absmax_names == 2 * (2 + 2 * 5)
    for world in (1, 3, 5):
        mine = {"load": urls["saved"], **{k: str(tmp_path / f"w{world}_{k}") for k in ("resaved", "after")}}
        buffers = run_at(train_llama_shapes, world, tmp_path, mine)[0]
        assert ("optim.exp_avg_sq_absmax.<root>.float32.1" in buffers) == (world == 5), (world, buffers)
        for url, want in ((mine["resaved"], saved), (mine["after"], after)):
            got = read_all(url)
            assert sorted(got) == sorted(want), world
            for n in want:
                assert got[n].dtype == want[n].dtype and torch.equal(_bits(got[n]), _bits(want[n])), (world, url, n)

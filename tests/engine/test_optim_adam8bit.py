"""8-bit Adam: the block-wise quantiser against a dense nearest-code search, and Adam8bit at 1-4
gloo ranks against an independent single-process reference of the same math."""

from __future__ import annotations

import pytest
import torch

from ragfsdp.optim import blockwise_quant as bq


def nearest_codes(x: torch.Tensor, block: int, qmap: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference quantiser: per block of `block` elements from element 0, scale by the absmax in
    float64 and take the nearest map value by a dense search (ties to the lower code)."""
    x64 = x.double().reshape(-1)
    codes, amaxes = [], []
    for s in range(0, x64.numel(), block):
        chunk = x64[s:s + block]
        a = chunk.abs().max()
        scaled = chunk / (a if a > 0 else 1.0)
        dist = (scaled[:, None] - qmap.double()[None, :]).abs()
        codes.append(dist.argmin(dim=1))  # argmin takes the first of equal distances: the lower code
        amaxes.append(a)
    return torch.cat(codes).to(torch.uint8), torch.stack(amaxes).float()


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

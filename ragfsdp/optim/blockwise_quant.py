"""Block-wise 8-bit quantisation with a dynamic map (the scheme of bitsandbytes' 8-bit optimizers).

Each block of consecutive values is scaled by its absolute maximum into [-1, 1] and every scaled
value is stored as the index (a uint8 code) of the nearest of 256 map values. The dynamic map spends
its codes on orders of magnitude rather than on a uniform grid: for exponent e = 0..6 the decade
`[10**(e-6) * 0.1, 10**(e-6)]` gets 2**e evenly spaced values per sign (signed map) or 2**(e+1)
(unsigned map, which has no negative half to pay for), plus 0 and 1. Adam's moments span many
orders of magnitude within a block, which a linear 8-bit grid would flush to zero.

A flat buffer is described by `Blocks`: a tiling of it into segments, each either a quantisation
block or a gap (elements of other tensors, padding) that is skipped. One absmax per block segment;
everything is vectorised over the whole buffer (segment reductions and `repeat_interleave`), so a
buffer of a million blocks costs a handful of kernel launches, not a Python loop per block.

Nearest-code search is exact: the scaled value is computed in float64 and compared with the exact
midpoints of neighbouring float32 map values (a float64 sum of two float32 values is exact), and a
value on a midpoint takes the lower code, so the result is a function of the inputs alone, the same
on any device and for any split of the buffer.
"""

from __future__ import annotations

import functools

import torch

BLOCK = 256


@functools.cache
def _map_cpu(signed: bool) -> torch.Tensor:
    values = [0.0, 1.0]
    for e in range(7):
        n = 2 ** e if signed else 2 ** (e + 1)
        # midpoints of n equal steps from 0.1 to 1, scaled into the decade ending at 10**(e-6)
        edges = torch.linspace(0.1, 1.0, n + 1, dtype=torch.float64)
        mids = ((edges[:-1] + edges[1:]) / 2 * 10.0 ** (e - 6)).tolist()
        values += mids
        if signed:
            values += [-m for m in mids]
    out = torch.tensor(sorted(values), dtype=torch.float64).to(torch.float32)
    assert out.numel() == 256 and bool((out[1:] > out[:-1]).all())
    return out


@functools.cache
def _map_on(signed: bool, device: torch.device) -> torch.Tensor:
    return _map_cpu(signed).to(device)


@functools.cache
def _midpoints_on(signed: bool, device: torch.device) -> torch.Tensor:
    """Exact float64 midpoints of neighbouring map values, kept per device (no copy per call)."""
    m = _map_cpu(signed).double()
    return ((m[:-1] + m[1:]) / 2).to(device)


def dynamic_map(signed: bool, device: torch.device | str | None = None) -> torch.Tensor:
    """The 256 sorted float32 map values (code i means value `map[i]`); signed for Adam's first
    moment, unsigned (all >= 0, twice as fine) for the second. Shared: do not modify it."""
    return _map_on(bool(signed), torch.device(device or "cpu"))


class Blocks:
    """A tiling of a flat buffer of `numel` elements into segments, in buffer order: segment i has
    `lengths[i]` elements and is a quantisation block when `is_block[i]` (else a gap that
    quantisation ignores and leaves code 0). Both are 1-D tensors on the buffer's device; the
    counts are taken once here so that a step never waits on the device to learn them."""

    __slots__ = ("block_index", "gaps", "is_block", "lengths", "n_blocks", "numel")

    def __init__(self, lengths: torch.Tensor, is_block: torch.Tensor) -> None:
        if lengths.dim() != 1 or is_block.shape != lengths.shape or is_block.dtype != torch.bool:
            raise ValueError("lengths and is_block must be 1-D and of one length, is_block of dtype bool")
        if lengths.numel() and int(lengths.min()) <= 0:
            raise ValueError("every segment length must be positive; leave empty segments out")
        self.lengths = lengths.long()
        self.is_block = is_block
        self.numel = int(lengths.sum())
        self.n_blocks = int(is_block.sum())
        self.gaps = self.n_blocks != lengths.numel()
        # positions of the block segments, for index_select/index_copy_ (a boolean mask would make
        # the device report how many it selected on every use)
        self.block_index = torch.nonzero(is_block).reshape(-1) if self.gaps else None

    def per_segment(self, per_block: torch.Tensor, fill: float) -> torch.Tensor:
        """One value per segment: `per_block` at the blocks, `fill` at the gaps."""
        if self.block_index is None:
            return per_block
        out = torch.full((self.lengths.numel(),), fill, dtype=per_block.dtype, device=per_block.device)
        return out.index_copy_(0, self.block_index, per_block)

    @staticmethod
    def of_tensor(numel: int, block: int = BLOCK, device: torch.device | str | None = None) -> Blocks:
        """A whole tensor's blocks: `block` elements each from element 0, the last one possibly short."""
        if block <= 0:
            raise ValueError(f"block must be a positive element count, got {block}")
        full, rest = divmod(int(numel), block)
        lengths = [block] * full + ([rest] if rest else [])
        return Blocks(torch.tensor(lengths, dtype=torch.long, device=device),
                      torch.ones(len(lengths), dtype=torch.bool, device=device))

    def expand(self, per_segment: torch.Tensor) -> torch.Tensor:
        """One value per segment repeated over the segment's elements (a buffer-sized tensor)."""
        return torch.repeat_interleave(per_segment, self.lengths, output_size=self.numel)


def _check(x: torch.Tensor, blocks: Blocks, what: str) -> None:
    if x.dim() != 1:
        raise ValueError(f"{what} must be a flat (1-D) buffer, got shape {tuple(x.shape)}; pass tensor.reshape(-1)")
    if x.numel() != blocks.numel:
        raise ValueError(f"{what} has {x.numel()} elements but the blocks tile {blocks.numel}; "
                         "describe the same buffer with Blocks")


def absmax(x: torch.Tensor, blocks: Blocks) -> torch.Tensor:
    """float32 absolute maximum of each block segment of flat `x`, in buffer order."""
    _check(x, blocks, "x")
    if blocks.lengths.numel() == 0:
        return torch.zeros(0, dtype=torch.float32, device=x.device)
    seg = torch.segment_reduce(x.detach().abs().float(), "max", lengths=blocks.lengths, unsafe=True)
    return seg if blocks.block_index is None else seg.index_select(0, blocks.block_index)


def quantize(x: torch.Tensor, blocks: Blocks, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 codes of flat `x`, float32 absmax per block). A block of zeros has absmax 0 and the
    code of 0; gaps get code 0 (buffers' padding must stay zero). Values are assumed finite; under
    the unsigned map a negative value takes the code of 0."""
    amax = absmax(x, blocks)
    per_seg = blocks.per_segment(torch.where(amax > 0, amax.double(), 1.0), 1.0)
    scaled = x.detach().double() / blocks.expand(per_seg)
    codes = torch.bucketize(scaled, _midpoints_on(bool(signed), x.device), out_int32=True).to(torch.uint8)
    if blocks.gaps:
        codes.mul_(blocks.expand(blocks.is_block.to(torch.uint8)))
    return codes, amax


def dequantize(codes: torch.Tensor, amax: torch.Tensor, blocks: Blocks, signed: bool) -> torch.Tensor:
    """float32 values of flat uint8 `codes` (gaps come back as 0)."""
    _check(codes, blocks, "codes")
    if codes.dtype != torch.uint8:
        raise ValueError(f"codes must be uint8, got {codes.dtype}")
    if amax.numel() != blocks.n_blocks:
        raise ValueError(f"amax has {amax.numel()} values but there are {blocks.n_blocks} blocks; "
                         "pass the absmax that quantize returned for these blocks")
    per_seg = blocks.per_segment(amax.float(), 0.0)
    values = dynamic_map(signed, codes.device).index_select(0, codes.int())
    return values.mul_(blocks.expand(per_seg))

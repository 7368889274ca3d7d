"""`Adam8bit`: AdamW with block-wise 8-bit moments (bitsandbytes' scheme) on the local shards.

Each parameter of at least `MIN_NUMEL` elements keeps its moments as uint8 codes of the dynamic map
(`blockwise_quant`), signed for `exp_avg` and unsigned for `exp_avg_sq`, with one float32 absmax per
block of 256 consecutive elements of the flattened tensor counted from element 0. The blocks are a
property of the tensor, not of the sharding: `Adam8bit.granularity` makes the planner cut tensors
only at block edges, so every block lives whole on one rank, each rank quantises its own blocks with
no communication, and the state (codes and absmax alike) is the same tensor at any world size, so
a checkpoint saved at W ranks loads at any other. (Quantisers whose blocks follow the shard, as
torchao's AdamW8bit, give a state that depends on W.) Smaller tensors keep float32 moments, as
bitsandbytes does: their state is negligible and quantising them costs accuracy for nothing.

Checkpoint tensors, per quantised parameter p: `optim.state.<p>.exp_avg_q` / `.exp_avg_sq_q` (uint8,
p's shape, in buffers laid out like p's group) and `.exp_avg_absmax` / `.exp_avg_sq_absmax` (float32,
one per block, in buffers whose layout puts each block's absmax on the rank owning its elements);
per small parameter `optim.state.<p>.exp_avg` / `.exp_avg_sq` (float32); per parameter `.step`.

A group's update walks the rank's shard in chunks of about `CHUNK` elements, each one vectorised
pass (dequantise, AdamW in float32, requantise) with the elements of small tensors and padding as
gaps that it leaves alone; the small tensors then get AdamW's own foreach update.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn

import ragckpt
from ragfsdp.engine.flat_group import FlatGroup, Piece
from ragfsdp.optim import blockwise_quant as bq
from ragfsdp.optim.adamw import adamw_foreach, check_adamw_group
from ragfsdp.optim.base import FlatOptimizer, Run, torch_hyperparameters, zeros_like_shard
from ragfsdp.optim.state_buffer import StateBuffer

MIN_NUMEL = 4096
BLOCK = bq.BLOCK


#: elements of a shard updated at once: the update's temporaries (about 40 bytes per element) stay
#: within a few hundred MiB whatever the shard size
CHUNK = 1 << 22


class _Chunk(NamedTuple):
    """Shard elements `[start, stop)`, tiled by `blocks` (quantised blocks and gaps); `absmax_at`:
    the blocks' positions in the local absmax (a slice when consecutive)."""

    start: int
    stop: int
    blocks: bq.Blocks
    absmax_at: slice | torch.Tensor


class _Plan(NamedTuple):
    """How one update pass walks a group's shard, chunk by chunk. `partial`: the gaps hold other
    quantised pieces (another param group's, or a step count's) whose codes must be kept."""

    chunks: list[_Chunk]
    partial: bool


class _GroupState:
    """The 8-bit and float32 state of one FlatGroup, and the plan of its update."""

    def __init__(self, opt: Adam8bit, group: FlatGroup) -> None:
        self.group = group
        numels = [math.prod(s) for s in group.shapes]
        self.qslots = [s for s, n in enumerate(numels) if n >= MIN_NUMEL]
        self.sslots = [s for s, n in enumerate(numels) if n < MIN_NUMEL]
        _check_blocks_whole(group, self.qslots)
        self.buffers: list[StateBuffer] = []
        self.codes: dict[str, StateBuffer] = {}
        self.absmax: dict[str, torch.Tensor] = {}  # this rank's absmax, every buffer's part back to back
        self.moments: dict[str, StateBuffer] = {}
        self._absmax_offset: dict[int, int] = {}
        self.absmax_slots = set(self.qslots)
        self._moment_offset: dict[tuple[int, int], int] = {}
        if self.qslots:
            for key in ("exp_avg", "exp_avg_sq"):
                self.codes[key] = self._codes_buffer(key + "_q")
            self.absmax_layouts, self._absmax_offset = self._absmax_layouts()
            for key in ("exp_avg", "exp_avg_sq"):
                self.buffers.append(self.codes[key])
                self.buffers += self._absmax_buffers(key)
        if self.sslots and not self.qslots:
            self.moments = {k: opt.moment_buffer(group, k) for k in ("exp_avg", "exp_avg_sq")}
        elif self.sslots:
            self.moments = {k: self._small_buffer(opt, k) for k in ("exp_avg", "exp_avg_sq")}
        self.buffers += list(self.moments.values())
        self._plans: dict[tuple[int, ...] | None, _Plan] = {}
        pieces = group.pieces()
        self.quantised_pieces = [pc for pc in pieces if pc.slot in self._absmax_offset]
        small = set(self.sslots)
        self.small_pieces = [pc for pc in pieces if pc.slot in small]

    # -- buffers -----------------------------------------------------------------------------------
    def _name(self, key: str) -> str:
        return f"optim.{key}." + self.group.buffer_name.removeprefix("params.")

    def _codes_buffer(self, key: str) -> StateBuffer:
        """uint8 codes laid out element for element like the group's shard: the update reads them at
        the parameters' own offsets. With small tensors in the group their places are padding."""
        g = self.group
        local = zeros_like_shard(g.shard.numel(), torch.uint8, g.device)
        names = tuple(f"optim.state.{g.param_names[s]}.{key}" for s in self.qslots)
        if not self.sslots:
            return StateBuffer(self._name(key), "uint8", g.buffer_name, None, names, local)
        lay = g.layout
        layout = ragckpt.FlatLayout(lay.world_size, lay.shard_size, tuple(lay.shapes[s] for s in self.qslots),
                                    tuple(lay.dims[s] for s in self.qslots), tuple(lay.offsets[s] for s in self.qslots))
        return StateBuffer(self._name(key), "uint8", None, layout, names, local)

    def _absmax_layouts(self) -> tuple[list[tuple[list[int], ragckpt.FlatLayout]], dict[int, int]]:
        """One float32 per block of each quantised tensor, on the rank that owns the block's elements:
        [(slots, FlatLayout of their absmax)], with {slot: offset of this rank's first absmax of it in
        the local absmax (the buffers' parts back to back)}.

        A 'ragged' checkpoint needs FlatLayouts: each tensor contiguous in a global buffer of W equal
        shards. Rank r holds its blocks' absmax tensor by tensor in shard order, a piece continued
        from rank r-1 first and one continued on rank r+1 last, so each tensor crossing one rank
        boundary stays contiguous. A tensor over three or more ranks must fill its middle ones
        (S/256 blocks each) while a rank holding several tensors' short last blocks can hold more
        than S/256: each such tensor gets a buffer of its own, shard size S/256."""
        g = self.group
        W = g.world_size
        seg = g.layout.segments()
        nblocks = {s: -(-math.prod(g.shapes[s]) // BLOCK) for s in self.qslots}
        pieces: dict[int, list[tuple[int, int, int, int]]] = {s: [] for s in self.qslots}  # (rank, offset, block, n)
        for s, f, n, r, o in zip(seg.slot, seg.flat_start, seg.length, seg.rank, seg.offset, strict=True):
            if int(s) in pieces:
                first = int(f) // BLOCK
                pieces[int(s)].append((int(r), int(o), first, -(-(int(f) + int(n)) // BLOCK) - first))
        spanning = [s for s in self.qslots if len(pieces[s]) > 2]
        shared = [s for s in self.qslots if len(pieces[s]) <= 2]
        out: list[tuple[list[int], ragckpt.FlatLayout]] = []
        where: dict[int, int] = {}
        base = 0
        for slots in ([shared] if shared else []) + [[s] for s in spanning]:
            per_rank: list[list[tuple[int, int, int, int]]] = [[] for _ in range(W)]
            for s in slots:
                for r, o, first, n in pieces[s]:
                    per_rank[r].append((o, s, first, n))
            S = max(sum(p[3] for p in pcs) for pcs in per_rank)
            start: dict[int, int] = {}
            for r, pcs in enumerate(per_rank):
                pcs.sort()
                pos = 0
                for i, (_, s, first, n) in enumerate(pcs):
                    at = S - n if i == len(pcs) - 1 and first + n < nblocks[s] else pos
                    if first == 0:
                        start[s] = r * S + at
                    if r == g.rank:
                        where[s] = base + at
                    pos += n
            out.append((slots, ragckpt.FlatLayout(W, S, tuple((nblocks[s],) for s in slots), (1,) * len(slots),
                                                  tuple(start[s] for s in slots))))
            base += S
        return out, where

    def _absmax_buffers(self, key: str) -> list[StateBuffer]:
        """The absmax buffers of `key`, their `local`s views of one tensor (`self.absmax[key]`) so that
        an update reads and writes all of them with one index."""
        g = self.group
        total = sum(lay.shard_size for _, lay in self.absmax_layouts)
        self.absmax[key] = zeros_like_shard(total, torch.float32, g.device)
        out, base = [], 0
        for i, (slots, lay) in enumerate(self.absmax_layouts):
            name = self._name(f"{key}_absmax") + (f".{i}" if i else "")
            names = tuple(f"optim.state.{g.param_names[s]}.{key}_absmax" for s in slots)
            out.append(StateBuffer(name, "float32", None, lay, names, self.absmax[key][base:base + lay.shard_size]))
            base += lay.shard_size
        return out

    def _small_buffer(self, opt: Adam8bit, key: str) -> StateBuffer:
        """float32 moments of the small tensors only (the base's subset buffer: each rank holds its
        pieces of them), so the quantised tensors cost nothing here. Unlike the absmax, that layout
        always exists: a rank in the middle of a tensor holds S elements, the most any rank holds."""
        names = [self.group.param_names[s] for s in self.sslots]
        sb, self._moment_offset = opt.subset_buffer(self.group, names, key)
        return sb

    def moment_view(self, key: str, pc: Piece) -> torch.Tensor:
        local = self.moments[key].local
        at = pc.offset if self.moments[key].like is not None else self._moment_offset[(pc.slot, pc.flat_start)]
        return local[at:at + pc.length]

    # -- update plans ------------------------------------------------------------------------------
    def plan(self, pieces: list[Piece] | None) -> _Plan:
        """The plan for this rank's quantised pieces among `pieces` (None: all of them); cached."""
        mine = self.quantised_pieces
        chosen = mine if pieces is None else [pc for pc in pieces if pc.slot in self._absmax_offset]
        key = None if len(chosen) == len(mine) else tuple(sorted(pc.slot for pc in chosen))
        if key not in self._plans:
            self._plans[key] = self._make_plan(sorted(chosen, key=lambda pc: pc.offset), key is not None)
        return self._plans[key]

    def _make_plan(self, pieces: list[Piece], partial: bool) -> _Plan:
        """Segments (blocks of the pieces, gaps between them) of the shard, cut into chunks of about
        CHUNK elements at segment edges, each trimmed to its first and last block."""
        lengths, is_block, at = [], [], []
        pos = 0
        for pc in pieces:
            if pc.offset > pos:
                lengths.append(np.array([pc.offset - pos]))
                is_block.append(np.zeros(1, dtype=bool))
            full, rest = divmod(pc.length, BLOCK)
            lengths.append(np.array([BLOCK] * full + ([rest] if rest else []), dtype=np.int64))
            is_block.append(np.ones(full + bool(rest), dtype=bool))
            first = self._absmax_offset[pc.slot]
            at.append(np.arange(first, first + full + bool(rest)))
            pos = pc.offset + pc.length
        if not pieces:
            return _Plan([], partial)
        seg_len, seg_block = np.concatenate(lengths).astype(np.int64), np.concatenate(is_block)
        where = np.concatenate(at).astype(np.int64)
        ends = np.cumsum(seg_len)
        starts = ends - seg_len
        block_no = np.cumsum(seg_block) - seg_block  # blocks before each segment
        chunk_of = starts // CHUNK
        cuts = [0, *(np.nonzero(np.diff(chunk_of))[0] + 1).tolist(), len(seg_len)]
        dev = self.group.device
        chunks = []
        for i, j in zip(cuts[:-1], cuts[1:], strict=True):
            inside = np.nonzero(seg_block[i:j])[0]
            if not len(inside):
                continue
            i, j = i + int(inside[0]), i + int(inside[-1]) + 1
            k0, k1 = int(block_no[i]), int(block_no[i] + seg_block[i:j].sum())
            pos_ = where[k0:k1]
            consecutive = bool(np.all(np.diff(pos_) == 1))
            absmax_at = slice(int(pos_[0]), int(pos_[-1]) + 1) if consecutive else torch.from_numpy(pos_).to(dev)
            blocks = bq.Blocks(torch.from_numpy(seg_len[i:j]).to(dev), torch.from_numpy(seg_block[i:j]).to(dev))
            chunks.append(_Chunk(int(starts[i]), int(ends[j - 1]), blocks, absmax_at))
        return _Plan(chunks, partial)


def _check_blocks_whole(group: FlatGroup, qslots: list[int]) -> None:
    """Every rank's piece of a quantised tensor must start on a block edge and end on one or at the
    tensor's end. Checked over all ranks' pieces (the layout is the same everywhere), so every rank
    refuses alike instead of one rank hanging the others."""
    seg = group.layout.segments()
    wanted = set(qslots)
    for s, f, n, r in zip(seg.slot, seg.flat_start, seg.length, seg.rank, strict=True):
        s, f, end = int(s), int(f), int(f) + int(n)
        if s not in wanted:
            continue
        cut = f if f % BLOCK else (end if end % BLOCK and end != math.prod(group.shapes[s]) else None)
        if cut is not None:
            raise ValueError(f"parameter '{group.param_names[s]}' is cut at element {cut} (rank {int(r)}), inside one "
                             f"of Adam8bit's {BLOCK}-element blocks; shard it with "
                             "ragfsdp.fully_shard(..., granularity=ragfsdp.optim.Adam8bit.granularity)")


class Adam8bit(FlatOptimizer):
    """AdamW (decoupled weight decay) with block-wise 8-bit moments; see the module docstring. Shard
    the model with `granularity=Adam8bit.granularity` so that no block is split between ranks."""

    MIN_NUMEL = MIN_NUMEL
    BLOCK = BLOCK

    @staticmethod
    def granularity(name: str, shape: tuple[int, ...]) -> str | int:
        """fully_shard's policy for this optimizer: tensors it quantises are cut only at multiples of
        both a block and a row (what the engine's placement needs); the others by whole rows."""
        numel = math.prod(shape)
        if numel < MIN_NUMEL:
            return "row"
        return math.lcm(BLOCK, math.prod(shape[1:]))

    def __init__(self, model: nn.Module, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0) -> None:
        if not lr >= 0:
            raise ValueError(f"lr must be >= 0, got {lr}")
        if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"betas must be two values in [0, 1), got {betas}")
        if not eps >= 0:
            raise ValueError(f"eps must be >= 0, got {eps}")
        if not weight_decay >= 0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        # torch AdamW's keys, so that exports of the float32 moments load into torch.optim.AdamW
        hyper = torch_hyperparameters(torch.optim.AdamW, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(model, hyper)
        self._state = [_GroupState(self, g) for g in self.groups]

    def state_buffers(self) -> list[StateBuffer]:
        return [sb for st in self._state for sb in st.buffers]

    def _update(self, gi: int, group: FlatGroup) -> None:
        assert group.grad is not None
        st = self._state[gi]
        for run in self.runs(gi, group):
            check_adamw_group(run.hyper)
            if run.hyper.get("maximize"):
                raise ValueError("param group option maximize=True is not supported by Adam8bit; set it to False")
            if st.qslots:
                self._update_quantised(st, run)
            if st.sslots:
                small = st.small_pieces if run.pieces is None else [pc for pc in run.pieces
                                                                    if pc.slot not in st.absmax_slots]
                if small:
                    sh, gr = group.shard, group.grad
                    adamw_foreach([sh[pc.offset:pc.offset + pc.length] for pc in small],
                                  [gr[pc.offset:pc.offset + pc.length] for pc in small],
                                  [st.moment_view("exp_avg", pc) for pc in small],
                                  [st.moment_view("exp_avg_sq", pc) for pc in small], run.hyper, run.step)

    def _update_quantised(self, st: _GroupState, run: Run) -> None:
        plan = st.plan(run.pieces)
        group = st.group
        assert group.grad is not None
        for ch in plan.chunks:
            sl = slice(ch.start, ch.stop)
            shard, grad = group.shard[sl], group.grad[sl]
            codes_m, codes_v = st.codes["exp_avg"].local[sl], st.codes["exp_avg_sq"].local[sl]
            abs_m, abs_v = st.absmax["exp_avg"], st.absmax["exp_avg_sq"]
            blocks = ch.blocks
            m = bq.dequantize(codes_m, abs_m[ch.absmax_at], blocks, signed=True)
            v = bq.dequantize(codes_v, abs_v[ch.absmax_at], blocks, signed=False)
            new_p = adam_block_update(shard.float(), grad.float(), m, v, run.hyper, run.step)
            q_m, a_m = bq.quantize(m, blocks, signed=True)
            q_v, a_v = bq.quantize(v, blocks, signed=False)
            if blocks.gaps:
                keep = blocks.expand(blocks.is_block)
                new_p = torch.where(keep, new_p, shard)
                if plan.partial:
                    q_m, q_v = torch.where(keep, q_m, codes_m), torch.where(keep, q_v, codes_v)
            shard.copy_(new_p)
            codes_m.copy_(q_m)
            codes_v.copy_(q_v)
            abs_m[ch.absmax_at] = a_m
            abs_v[ch.absmax_at] = a_v


def adam_block_update(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
                      hyper: dict[str, Any], step: float) -> torch.Tensor:
    """The new float32 parameters; `m` and `v` (dequantised moments) are updated in place. torch's
    AdamW arithmetic, op for op, so that an unquantised run would agree with it."""
    lr, (beta1, beta2), eps, wd = float(hyper["lr"]), hyper["betas"], hyper["eps"], hyper["weight_decay"]
    if wd != 0:
        p = p * (1 - lr * wd)
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    step_size = lr / (1 - beta1 ** step)
    denom = (v.sqrt() / ((1 - beta2 ** step) ** 0.5)).add_(eps)
    return p.addcdiv(m, denom, value=-step_size)

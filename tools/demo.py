"""End-to-end demo on local files: 8 simulated ranks save, reshard to 3, read back, verify.

Run with `make demo` (or `python tools/demo.py [--out DIR]`). It builds a small Llama-shaped model
state with Adam moments, lays it out with the structure-aware planner for 8 ranks, has each
simulated rank save its own flat buffers (the engine's save path: `save_shard`, then one `commit`),
reshards the checkpoint offline to 3 ranks in FSDP2 row layout, reads every tensor back and checks
it bit for bit against the original.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

import ragckpt
from ragckpt.format.names import optim_state_name
from ragckpt.reshard.offline import reshard


def llama_like_state(layers: int = 4, hidden: int = 256, inter: int = 688, vocab: int = 1000) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    s: dict[str, torch.Tensor] = {"model.embed_tokens.weight": torch.randn(vocab, hidden, generator=g)}
    for i in range(layers):
        p = f"model.layers.{i}."
        for n, shape in [("self_attn.q_proj.weight", (hidden, hidden)), ("self_attn.k_proj.weight", (hidden // 4, hidden)),
                         ("self_attn.v_proj.weight", (hidden // 4, hidden)), ("self_attn.o_proj.weight", (hidden, hidden)),
                         ("mlp.gate_proj.weight", (inter, hidden)), ("mlp.up_proj.weight", (inter, hidden)),
                         ("mlp.down_proj.weight", (hidden, inter)), ("input_layernorm.weight", (hidden,)),
                         ("post_attention_layernorm.weight", (hidden,))]:
            s[p + n] = torch.randn(*shape, generator=g)
    s["model.norm.weight"] = torch.ones(hidden)
    s["lm_head.weight"] = torch.randn(vocab, hidden, generator=g)
    return s


def rank_buffer(layout: ragckpt.FlatLayout, values: list[torch.Tensor], rank: int) -> torch.Tensor:
    """What rank `rank` holds in memory: its slice of the global flat buffer."""
    buf = torch.zeros(int(layout.rank_sizes()[rank]), dtype=values[0].dtype)
    seg = layout.rank_segments(rank)
    for i in range(len(seg)):
        t = values[int(seg.slot[i])].reshape(-1)
        o, fs, n = int(seg.offset[i]), int(seg.flat_start[i]), int(seg.length[i])
        buf[o : o + n] = t[fs : fs + n]
    return buf


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=None, help="directory for the checkpoints (default: a temp dir, removed)")
    args = ap.parse_args(argv)
    root = Path(args.out or tempfile.mkdtemp(prefix="ragckpt-demo-"))
    root.mkdir(parents=True, exist_ok=True)
    src, dst = str(root / "step_100_w8"), str(root / "step_100_w3")
    for p in (src, dst):
        shutil.rmtree(p, ignore_errors=True)

    params = llama_like_state()
    names = list(params)
    W = 8
    t0 = time.perf_counter()
    layout = ragckpt.CheckpointLayout.build({n: (tuple(t.shape), "float32") for n, t in params.items()}, W,
                                            "ragged", granularity="row", align=64)
    g = torch.Generator().manual_seed(1)
    moments = {key: [torch.randn(t.shape, generator=g) for t in params.values()] for key in ("exp_avg", "exp_avg_sq")}
    for key in moments:  # Adam moments share the parameters' layout: one flat buffer each
        layout = layout.with_buffer(f"optim.{key}", "float32", like="float32",
                                    tensors=[optim_state_name(n, key) for n in names])
    flat = layout.layout_of(0)
    print(f"planned {len(names)} tensors for {W} ranks: {flat.shard_size:,} elements per rank, "
          f"padding {flat.padding() / (flat.shard_size * W):.3%}")

    values = list(params.values())
    for r in range(W):  # every simulated rank saves only its own buffers
        bufs = {"float32": rank_buffer(flat, values, r)}
        bufs.update({f"optim.{k}": rank_buffer(flat, v, r) for k, v in moments.items()})
        ragckpt.save_shard(src, r, bufs, layout, extra={"rng": torch.tensor([r], dtype=torch.int64)},
                           user={"step": 100})
    ragckpt.commit(src)
    t_save = time.perf_counter() - t0
    ck = ragckpt.open(src)
    print(f"saved {ck.layout.total_bytes() / 2**20:.1f} MiB from {W} ranks in {t_save:.2f}s -> {src}")

    stats = reshard(src, dst, 3, layout="row")
    print(f"resharded {W} -> 3 ranks (ragged -> row) in {stats.seconds:.2f}s, "
          f"{stats.bytes_written / 2**20:.1f} MiB written")

    out = ragckpt.open(dst)
    want = {**params}
    for k, v in moments.items():
        want.update({optim_state_name(n, k): t for n, t in zip(names, v, strict=True)})
    mismatched = [n for n, t in want.items() if not torch.equal(out.read(n).view(torch.int32), t.view(torch.int32))]
    rep = out.verify()
    print(f"read back {len(want)} tensors from {out.world_size} ranks ({out.kind} layout): "
          f"{'all bit-identical' if not mismatched else f'{len(mismatched)} MISMATCHED'}; "
          f"verify: {'OK' if rep.ok else rep.problems[:3]} ({rep.objects} objects)")
    up = out.meta("model.layers.0.mlp.up_proj.weight")
    print(f"e.g. model.layers.0.mlp.up_proj.weight {up.shape} now RaggedShard(dims={up.placement.dims}, "
          f"local_units={up.placement.local_units}); user metadata {out.user}")
    if args.out is None:
        shutil.rmtree(root, ignore_errors=True)
    return 0 if not mismatched and rep.ok else 1


if __name__ == "__main__":
    sys.exit(main())

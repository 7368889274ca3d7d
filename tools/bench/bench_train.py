"""Training steps: ragfsdp against torch's FSDP2 on the same Llama, batch and world size (gloo, CPU).

A transformers `LlamaForCausalLM` is built from a `LlamaConfig` on the spot (no download), from the
same seed on every rank, and sharded per decoder layer then the root, by `ragfsdp.fully_shard` or by
`torch.distributed.fsdp.fully_shard` (FSDP2, on a CPU device mesh). Each rank trains on its own
`--batch-size` sequences of `--seq-len` random tokens (the same tokens for both engines). The
optimizer: torch's AdamW on FSDP2's DTensor parameters against `ragfsdp.optim.AdamW` when that module
exists; otherwise a plain SGD update on both sides (the output says which). Each engine runs in its
own set of processes, so that the peak resident memory of one does not leak into the other's.

Measured per engine and world size, after --warmup untimed steps:
  * step time: forward + backward + optimizer step, between two barriers, the slowest rank; the
    median over --steps steps; tokens/s = every rank's tokens over it; and the CPU seconds of the
    rank's process per step (all its threads, gloo's included), which other load on the machine
    disturbs less than the wall time; with --repeat N, N runs each, the engines' order alternating,
    each keeping its fastest;
  * peak memory per rank: the kernel's resident high-water mark (VmHWM, reset through
    /proc/self/clear_refs once the model, optimizer and first batch exist, so model construction does
    not count), the largest over ranks; and the state the engine itself holds per rank, counted from
    the tensors: parameter shards, gradient shards and optimizer state;
  * bytes copied outside collectives per step: ragfsdp counts its own (`ragfsdp.engine.stats`);
    FSDP2's are *computed* from its parameter and gradient sizes: each all-gather copies the shards in
    and the gathered parameters out (`foreach_all_gather` copy-in / copy-out; the root is gathered
    once, every other unit again for the backward), and each reduce-scatter copies the unsharded
    gradients in (`chunk_cat`);
  * the losses of both engines, step by step (a check that both train the same model);
  * ragfsdp's padding: the planner's padding elements per group (`FlatLayout.padding()`).
The CPU is shared by the ranks (and by anything else running), so the timings are noisy and, once
there are more ranks than cores, mostly measure the time-slicing of ranks.

Usage: python -m tools.bench.bench_train [--world-sizes 2,4] [--steps 4] [--warmup 1] [--seq-len 128]
       [--batch-size 2] [--model-size small|base] [--repeat 1] [--quick]
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import json
import statistics
import sys
import time
from typing import Any

from tools.bench import procs
from tools.bench.llama import make_llama

MODULE = "tools.bench.bench_train"
ENGINES = ("fsdp2", "ragfsdp")
LR, BETAS, WD = 1e-3, (0.9, 0.95), 0.1
SGD_LR = 0.05
GLOO_TIMEOUT = datetime.timedelta(minutes=10)
# (hidden, intermediate, layers, heads, kv heads); vocabulary 32000 for both
SIZES = {"small": (512, 1408, 8, 8, 4), "base": (768, 2048, 12, 12, 12)}
VOCAB = 32000
TARGET_TOKENS, TARGET_MEMORY = 1.05, 0.9


def tokens(step: int, rank: int, batch: int, seq_len: int) -> Any:
    import torch

    g = torch.Generator().manual_seed(10_000 * step + rank)
    return torch.randint(0, VOCAB, (batch, seq_len), generator=g)


def _ragfsdp_adamw() -> Any | None:
    try:
        from ragfsdp.optim import AdamW  # type: ignore[attr-defined]
    except ImportError:
        return None
    return AdamW


def optimizer_name() -> str:
    return "AdamW" if _ragfsdp_adamw() is not None else "SGD"


# -- inside one rank ---------------------------------------------------------------------------------

def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def _reset_peak() -> bool:
    """Give freed heap back to the kernel, then reset the resident high-water mark (Linux >= 4.0)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _nbytes(t: Any) -> int:
    return 0 if t is None else t.numel() * t.element_size()


class Fsdp2:
    def __init__(self, model: Any, world: int, opt: str) -> None:
        import torch
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        self.units = [*model.model.layers, model]
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        self.model = model
        self.optim = (torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WD) if opt == "AdamW"
                      else torch.optim.SGD(model.parameters(), lr=SGD_LR))

    def step(self) -> None:
        self.optim.step()

    def zero_grad(self) -> None:
        self.optim.zero_grad(set_to_none=True)

    def state_bytes(self) -> dict[str, int]:
        from torch.distributed.tensor import DTensor

        def local(t: Any) -> Any:
            return t.to_local() if isinstance(t, DTensor) else t
        ps = list(self.model.parameters())
        opt = sum(_nbytes(local(v)) for p in ps for v in self.optim.state.get(p, {}).values() if hasattr(v, "numel"))
        return {"params": sum(_nbytes(local(p)) for p in ps), "grads": sum(_nbytes(local(p.grad)) for p in ps),
                "optimizer": opt}

    def copy_bytes_per_step(self) -> int:
        """Computed, not counted (see the module docstring): per unit, its shards in and its unsharded
        parameters out at each all-gather (once for the root, twice for the others), its unsharded
        gradients in at the reduce-scatter."""
        total = 0
        in_layers = {id(p) for u in self.units[:-1] for p in u.parameters()}
        for i, u in enumerate(self.units):
            direct = [p for p in u.parameters() if u is not self.model or id(p) not in in_layers]
            full = sum(p.numel() * p.element_size() for p in direct)  # DTensor numel: the global size
            shard = sum(_nbytes(p.to_local()) for p in direct)
            gathers = 1 if i == len(self.units) - 1 else 2
            total += gathers * (shard + full) + full
        return total

    def padding(self) -> list[tuple[str, int]]:
        return []


class Ragfsdp:
    def __init__(self, model: Any, world: int, opt: str) -> None:
        import ragfsdp

        for layer in model.model.layers:
            ragfsdp.fully_shard(layer)
        ragfsdp.fully_shard(model)
        self.model = model
        self.groups = ragfsdp.flat_groups(model)
        self.optim = _ragfsdp_adamw()(model, lr=LR, betas=BETAS, weight_decay=WD) if opt == "AdamW" else None

    def step(self) -> None:
        import torch

        if self.optim is not None:
            self.optim.step()
            return
        with torch.no_grad():
            for g in self.groups:
                g.shard.sub_(SGD_LR * g.grad)

    def zero_grad(self) -> None:
        if self.optim is not None and hasattr(self.optim, "zero_grad"):
            self.optim.zero_grad()
        for g in self.groups:
            g.grad = None

    def state_bytes(self) -> dict[str, int]:
        opt = 0
        if self.optim is not None and hasattr(self.optim, "checkpoint_buffers"):
            opt = sum(_nbytes(b.local) for b in self.optim.checkpoint_buffers())
        return {"params": sum(_nbytes(g.shard) for g in self.groups),
                "grads": sum(_nbytes(g.grad) for g in self.groups), "optimizer": opt}

    def padding(self) -> list[tuple[str, int]]:
        return [(g.buffer_name, int(g.layout.padding())) for g in self.groups]


def _role(args: argparse.Namespace) -> int:
    import os

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=GLOO_TIMEOUT)
    opt = args.optim
    model = make_llama(SIZES[args.model_size], VOCAB, args.seq_len)
    n_params = sum(p.numel() for p in model.parameters())
    eng = (Fsdp2 if args.role == "fsdp2" else Ragfsdp)(model, world, opt)
    if args.role == "ragfsdp":
        import ragfsdp

        copy_stats = lambda: ragfsdp.engine.stats(model)  # noqa: E731
    else:
        copy_stats = None
    reset_ok = _reset_peak()
    rss_start = _status_kib("VmRSS")
    losses, times, cpu, copies, state = [], [], [], [], {}
    for step in range(args.warmup + args.steps):
        ids = tokens(step, rank, args.batch_size, args.seq_len)
        before = copy_stats() if copy_stats else None
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if step == args.warmup + args.steps - 1:
            state = eng.state_bytes() if opt == "SGD" else {}
        eng.step()
        if step == args.warmup + args.steps - 1 and opt == "AdamW":
            state = eng.state_bytes()
        eng.zero_grad()
        dist.barrier()
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        t = torch.tensor([loss.item()])
        dist.all_reduce(t)
        losses.append(t.item() / world)
        if step >= args.warmup:
            times.append(dt)
            cpu.append(dc)
            if copy_stats:
                after = copy_stats()
                copies.append({k: after[k] - before[k] for k in after})
    if opt == "AdamW" and not state.get("grads"):
        state["grads"] = state.get("params", 0)  # grads are dropped by zero_grad; same size as the shards
    out = {"rank": rank, "times": times, "cpu": cpu, "losses": losses, "peak_kib": _status_kib("VmHWM"), "rss_start_kib": rss_start,
           "reset_ok": reset_ok, "state": state, "params": n_params, "padding": eng.padding(),
           "copies": copies, "computed_copy": eng.copy_bytes_per_step() if isinstance(eng, Fsdp2) else None}
    dist.barrier()
    dist.destroy_process_group()
    print(json.dumps(out))
    return 0


# -- the driver --------------------------------------------------------------------------------------

def run_one(engine: str, world: int, args: argparse.Namespace, opt: str) -> dict:
    common = ["--steps", str(args.steps), "--warmup", str(args.warmup), "--seq-len", str(args.seq_len),
              "--batch-size", str(args.batch_size), "--model-size", args.model_size, "--optim", opt]
    res = procs.run_ranks(MODULE, engine, world, common)
    step_times = [max(r["times"][i] for r in res) for i in range(args.steps)]
    med = statistics.median(step_times)
    cpu = statistics.median(max(r["cpu"][i] for r in res) for i in range(args.steps))
    return {"step_s": med, "step_times": step_times, "cpu_s": cpu,
            "tokens_per_s": world * args.batch_size * args.seq_len / med,
            "peak_mib": max(r["peak_kib"] for r in res) / 1024,
            "rss_start_mib": max(r["rss_start_kib"] for r in res) / 1024,
            "reset_ok": all(r["reset_ok"] for r in res),
            "state_mib": max(sum(r["state"].values()) for r in res) / 2**20,
            "state": res[0]["state"], "losses": res[0]["losses"], "params": res[0]["params"],
            "padding": res[0]["padding"],
            "copy_bytes": (statistics.median(c["copy_bytes"] for c in res[0]["copies"]) if res[0]["copies"]
                           else res[0]["computed_copy"]),
            "collectives": ({k: v for k, v in res[0]["copies"][-1].items() if k != "copy_bytes"}
                            if res[0]["copies"] else None)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-sizes", default="2,4", help="comma-separated gloo world sizes")
    ap.add_argument("--steps", type=int, default=4, help="timed steps")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=2, help="sequences per rank")
    ap.add_argument("--model-size", choices=sorted(SIZES), default="small", help="small: 56 M, base: 134 M params")
    ap.add_argument("--repeat", type=int, default=1,
                    help="runs per engine and world size, the engines' order alternating; each keeps its fastest")
    ap.add_argument("--quick", action="store_true", help="2 ranks, 2 steps of 64 tokens (for make bench)")
    ap.add_argument("--gib", type=float, default=None, help=argparse.SUPPRESS)  # run_all passes it to all; unused
    ap.add_argument("--role", choices=ENGINES, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--optim", choices=["AdamW", "SGD"], default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.role:
        return _role(args)
    if args.quick:
        args.world_sizes, args.steps, args.seq_len = "2", 2, 64
    worlds = [int(w) for w in args.world_sizes.split(",") if w]
    opt = optimizer_name()
    t_start = time.perf_counter()
    results: dict[int, dict[str, dict]] = {}
    for w in worlds:
        results[w] = {}
        for rep in range(max(1, args.repeat)):
            for e in (ENGINES if rep % 2 == 0 else ENGINES[::-1]):
                r = run_one(e, w, args, opt)
                if e not in results[w] or r["step_s"] < results[w][e]["step_s"]:
                    results[w][e] = r
    wall = time.perf_counter() - t_start

    first = results[worlds[0]]["ragfsdp"]
    print(f"model: LlamaForCausalLM {first['params'] / 1e6:.1f} M params ({args.model_size}), {args.batch_size} x "
          f"{args.seq_len} tokens per rank, fp32, gloo on CPU; optimizer: "
          + ("torch.optim.AdamW (FSDP2) vs ragfsdp.optim.AdamW" if opt == "AdamW"
             else "plain SGD on both (ragfsdp.optim.AdamW not there yet)")
          + f"; {args.warmup} warm-up + median of {args.steps} steps, best of {max(1, args.repeat)} runs")
    print("timings on a shared CPU are noisy; with more ranks than cores they measure time-slicing. cpu s: the "
          "CPU seconds of a rank's process (all its threads) per step, the largest rank: less sensitive to other load")
    print(f"{'W':>2} {'engine':8} {'step s':>8} {'cpu s':>6} {'tokens/s':>9} {'peak MiB':>9} {'start MiB':>9} "
          f"{'state MiB':>9} {'copy MiB/step':>13}  losses")
    summary: dict[str, Any] = {"optimizer": opt, "params": first["params"], "model_size": args.model_size,
                               "seq_len": args.seq_len, "batch_size": args.batch_size, "steps": args.steps}
    ok = True
    for w in worlds:
        for e in ENGINES:
            r = results[w][e]
            note = " (computed)" if e == "fsdp2" else ""
            print(f"{w:>2} {e:8} {r['step_s']:8.3f} {r['cpu_s']:6.2f} {r['tokens_per_s']:9.0f} {r['peak_mib']:9.0f} "
                  f"{r['rss_start_mib']:9.0f} {r['state_mib']:9.1f} {r['copy_bytes'] / 2**20:13.1f}{note}  "
                  + " ".join(f"{x:.4f}" for x in r["losses"]))
        a, b = results[w]["ragfsdp"], results[w]["fsdp2"]
        tok, mem = a["tokens_per_s"] / b["tokens_per_s"], a["peak_mib"] / b["peak_mib"]
        train_mem = (a["peak_mib"] - a["rss_start_mib"]) / max(b["peak_mib"] - b["rss_start_mib"], 1e-9)
        dloss = max(abs(x - y) for x, y in zip(a["losses"], b["losses"], strict=True))
        print(f"W={w} ragfsdp / FSDP2: tokens/s {tok:.2f}x (target >= {TARGET_TOKENS}x; per CPU second "
              f"{b['cpu_s'] / a['cpu_s']:.2f}x), peak memory {mem:.2f}x "
              f"(target <= {TARGET_MEMORY}x; growth during training {train_mem:.2f}x), state "
              f"{a['state_mib'] / b['state_mib']:.2f}x, largest loss difference {dloss:.2e}")
        if not (a["reset_ok"] and b["reset_ok"]):
            print("  note: the resident high-water mark could not be reset; peaks include model construction")
        pad = a["padding"]
        print(f"  ragfsdp planner padding at W={w}: {sum(p for _, p in pad)} elements over {len(pad)} groups"
              + (f" (largest: {max(pad, key=lambda x: x[1])[0]} {max(p for _, p in pad)})" if pad else ""))
        if a["collectives"]:
            c = a["collectives"]
            print(f"  ragfsdp collectives per step: {c}")
            # on gloo ragfsdp's all-gather fills this rank's slice from its shard and its reduce-scatter
            # copies this rank's slice out (ragfsdp.engine.collectives): copies inside its collectives,
            # where gloo's own all-gather and reduce-scatter (FSDP2's) copy the full size
            inside = (c["all_gather_bytes"] + c["reduce_scatter_bytes"]) / w
            print(f"  inside ragfsdp's gloo collectives: {inside / 2**20:.1f} MiB/step of slice copies (gloo's "
                  f"own collectives, which FSDP2 uses, copy at least {(c['all_gather_bytes'] + c['reduce_scatter_bytes']) / 2**20:.1f})")
        ok = ok and dloss < 1e-2
        summary[f"W{w}"] = {e: {k: results[w][e][k] for k in ("step_s", "step_times", "cpu_s", "tokens_per_s", "peak_mib",
                                                                 "rss_start_mib", "state_mib", "copy_bytes", "losses")}
                            for e in ENGINES}
        summary[f"W{w}"]["ratios"] = {"tokens_per_s": tok, "tokens_per_cpu_s": b["cpu_s"] / a["cpu_s"],
                                      "peak_memory": mem, "training_memory_growth": train_mem}
        summary[f"W{w}"]["padding_elements"] = sum(p for _, p in pad)
    summary["wall_seconds"] = wall
    print(f"{wall:.0f}s in all")
    print(json.dumps({"bench_train": summary}))
    if not ok:
        print("the two engines' losses differ: they did not train the same model")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

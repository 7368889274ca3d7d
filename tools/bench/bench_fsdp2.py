"""FSDP2 checkpoints: `ragckpt.integrations.fsdp2` against `torch.distributed.checkpoint` (DCP), the
way an FSDP2 (`fully_shard`) job saves and restarts.

A stack of Linear layers (odd row counts, so every parameter splits unevenly) is sharded by FSDP2 over
--procs gloo processes and takes one AdamW step, so its checkpoint state is params + exp_avg +
exp_avg_sq (fp32, about --gib GiB) plus Adam's `step` and hyperparameters. Then, with the contenders
taking turns within each of --repeat rounds (each keeps its best time):
  * save, all --procs processes, each contender into a fresh directory on the work disk (kept until
    the end: deleting on this VM's ext4 with `discard` slows whatever touches the disk next):
    `dcp.save({"model": msd, "optim": osd})` against `save_state_dict(url, {"model": msd, "optim": osd})`,
    timed from a barrier before to a barrier after, so everything each needs for a durable, complete
    checkpoint is inside: DCP's fsync of every file and its .metadata, ragckpt's fsyncs and commit;
  * load at another world size: a fresh job of --load-procs processes builds the same model with
    another seed and learning rate, takes `get_state_dict` of a fresh optimizer, and restores both
    round-one saves: `dcp.load` + `set_state_dict` against `load_state_dict` + `set_state_dict`, cold
    (the saved files evicted from the page cache first, as after a restart), then warm (the files read
    into the page cache first, then loaded again).
Before every load the job's parameters and Adam state are overwritten with NaN (and the lr reset), so
a path that silently restores nothing cannot pass. In the first round each process checks, untimed,
that both contenders' loads left its parameters, moments and steps bit for bit equal, that they match
the saved state's exact fingerprint (integer sums of every tensor's bits, taken by the saving job),
and that the saved learning rate came back. Then background saves, taking turns likewise:
`async_save_state_dict` (keeping one StagingBuffers per rank) against `dcp.async_save` (on its own gloo
group, as DCP advises), each timed for how long the call blocks training and until its future is done.
Prints GB/s over the state's tensor bytes, ragckpt/DCP ratios and a one-line JSON summary.

Usage: python -m tools.bench.bench_fsdp2 [--gib 1.0] [--procs 4] [--load-procs 2] [--repeat 2] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import math
import os
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING

from tools.bench import procs
from tools.bench.cache import drop_page_cache
from tools.bench.floors import read_tree
from tools.bench.report import print_rates, print_ratios

if TYPE_CHECKING:
    import torch

MODULE = "tools.bench.bench_fsdp2"
CONTENDERS = ("ragckpt", "dcp")
SAVE_SEED, SAVE_LR = 0, 1e-3  # the trained job's
LOAD_SEED, LOAD_LR = 1, 0.5  # the restarted job's own, before the load replaces them
STATE_BYTES_PER_PARAM = 12  # fp32 parameter + exp_avg + exp_avg_sq
GLOO_TIMEOUT = datetime.timedelta(minutes=5)  # a lost rank fails the run instead of hanging it for 30 min


# -- the model ---------------------------------------------------------------------------------------

def widths(gib: float) -> list[int]:
    """Feature sizes of a Linear stack whose params + Adam moments come to about `gib` GiB. All odd,
    so every weight and bias splits unevenly over 2 and 4 ranks (torch.chunk leaves the last rank
    short), as real models' vocabularies and odd hidden sizes do; at least 2 layers, width <= 2051."""
    params = gib * 2**30 / STATE_BYTES_PER_PARAM
    base = min(2048, max(64, int(math.sqrt(params / 8))))
    layers = max(2, round(params / (base * base)))
    return [base + 1 + 2 * (i % 3) for i in range(layers + 1)]


def build(gib: float, seed: int, lr: float) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The FSDP2 model (each Linear its own `fully_shard` unit, as a transformer block would be, then
    the root) and its AdamW optimizer. Every rank builds the full model from the same seed first, as
    a plain FSDP2 script does, so the global parameters are the same whatever the world size."""
    import torch
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    w = widths(gib)
    model = torch.nn.Sequential(*(torch.nn.Linear(a, b) for a, b in zip(w[:-1], w[1:], strict=True)))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)


def train_step(model: torch.nn.Module, optim: torch.optim.Optimizer, rank: int) -> None:
    """One forward, backward and AdamW step, so exp_avg, exp_avg_sq and step exist and hold values
    that differ per element (what a real checkpoint holds; zeros would hide a misplaced row)."""
    import torch

    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(8, model[0].in_features, generator=g)
    model(x).square().mean().backward()
    optim.step()
    optim.zero_grad(set_to_none=True)


def local_tensors(model: torch.nn.Module, optim: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor, bool]]:
    """(key, this rank's local tensor, sharded?) of every parameter and every optimizer state tensor,
    read straight from the model and the optimizer (not from a state dict, which could be a copy):
    what the job actually runs with after a restore. Call under `torch.no_grad()`, where a DTensor's
    `to_local()` is its storage itself."""
    from torch.distributed.tensor import DTensor

    out = []
    for name, p in model.named_parameters():
        out.append((name, p.to_local(), True))
        for k, v in sorted(optim.state.get(p, {}).items()):
            if isinstance(v, DTensor):
                out.append((f"{name}.{k}", v.to_local(), True))
            elif hasattr(v, "view"):  # Adam's 0-d `step`: a plain tensor every rank holds
                out.append((f"{name}.{k}", v, False))
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bytes as integers, for bit-for-bit comparisons (NaN == NaN, -0.0 != 0.0)."""
    import torch

    flat = t.detach().reshape(-1)
    return flat.view(torch.int32) if flat.element_size() == 4 else flat.view(torch.uint8)


def fingerprint(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, int]:
    """Every tensor's integer sum of its bits over the whole world: exact and independent of how it is
    sharded, so a job at another world size can check it restored exactly the saved state. One
    all_reduce; every rank gets the same dict."""
    import torch
    import torch.distributed as dist

    with torch.no_grad():
        items = local_tensors(model, optim)
        sums = torch.stack([bits(t).sum(dtype=torch.int64) for _, t, _ in items])
    sharded = torch.tensor([s for _, _, s in items])
    total = torch.where(sharded, sums, torch.zeros_like(sums))
    dist.all_reduce(total)
    total = torch.where(sharded, total, sums)  # a replicated tensor counts once, not once per rank
    return {key: int(v) for (key, _, _), v in zip(items, total.tolist(), strict=True)}


def poison(model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
    """Overwrite all the state a load must restore (NaN in every parameter and moment, -1 in every
    step, the restarted job's own lr), so what a contender leaves untouched shows up in the check
    instead of passing with the previous contender's values."""
    import torch

    with torch.no_grad():
        for _, t, _ in local_tensors(model, optim):
            t.fill_(float("nan") if t.is_floating_point() and t.dim() else -1)
    for group in optim.param_groups:
        group["lr"] = LOAD_LR


def state_bytes(state: dict) -> int:
    """Tensor bytes of the global state (a DTensor's numel is global; Adam's plain `step` tensors,
    replicated, count once): what both contenders must store and restore."""
    import torch

    total = 0
    for part in state.values():
        for v in part.values():
            if isinstance(v, torch.Tensor):
                total += v.numel() * v.element_size()
    return total


# -- the two contenders -----------------------------------------------------------------------------

def _save_ragckpt(path: str, state: dict) -> None:
    from ragckpt.integrations.fsdp2 import save_state_dict

    save_state_dict(path, state)  # returns once rank 0 has committed (fsynced before the marker)


def _save_dcp(path: str, state: dict) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=path)  # FileSystemWriter defaults: sync_files=True, 1 thread


def _load_ragckpt(path: str, state: dict) -> None:
    from ragckpt.integrations.fsdp2 import load_state_dict

    load_state_dict(path, state)


def _load_dcp(path: str, state: dict) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.load(state, checkpoint_id=path)


def _async_ragckpt(path: str, state: dict, keep: dict) -> Future:
    from ragckpt.integrations.fsdp2 import async_save_state_dict

    return async_save_state_dict(path, state, staging=keep["staging"])


def _async_dcp(path: str, state: dict, keep: dict) -> Future:
    import torch.distributed.checkpoint as dcp

    return dcp.async_save(state, checkpoint_id=path, process_group=keep["group"])  # as DCP's docs advise: gloo


SAVES: dict[str, Callable[[str, dict], None]] = {"ragckpt": _save_ragckpt, "dcp": _save_dcp}
ASYNC_SAVES: dict[str, Callable[[str, dict, dict], Future]] = {"ragckpt": _async_ragckpt, "dcp": _async_dcp}
LOADS: dict[str, Callable[[str, dict], None]] = {"ragckpt": _load_ragckpt, "dcp": _load_dcp}


def turns(round_: int) -> tuple[str, ...]:
    """Who goes first alternates between rounds: on this VM the disk's state after one contender
    changes what the next one gets."""
    return CONTENDERS if round_ % 2 == 0 else CONTENDERS[::-1]


def durability() -> dict[str, str]:
    """What each contender's timed save includes to be durable, read from the code that runs (DCP's
    default `sync_files` from its FileSystemWriter; ragckpt always syncs before its commit marker)."""
    from torch.distributed.checkpoint import FileSystemWriter

    sync = inspect.signature(FileSystemWriter.__init__).parameters["sync_files"].default
    return {
        "ragckpt": "fsync: yes (data objects written O_DIRECT, then every object and directory fsynced before each "
                   "rank's record; rank 0 then commits: the marker written, fsynced and linked in)",
        "dcp": f"fsync: {'yes' if sync else 'NO'} (dcp.save's FileSystemWriter, sync_files={sync}: every data "
               "file and .metadata fsynced; 1 writer thread per rank, the default)",
    }


# -- roles run inside rank processes -----------------------------------------------------------------

def _timed(fn: Callable[[], None]) -> float:
    """Seconds from a barrier before `fn` to a barrier after it: the slowest rank's time, so
    the result is when the whole job could go on."""
    import torch.distributed as dist

    dist.barrier()
    t = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t


def _save_role(args: argparse.Namespace, rank: int) -> dict:
    """Train one step at --procs ranks, then save with both contenders, taking turns, each round into
    fresh directories `<path>/<contender><round>`."""
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model, optim = build(args.gib, SAVE_SEED, SAVE_LR)
    train_step(model, optim, rank)
    msd, osd = get_state_dict(model, optim, options=StateDictOptions(flatten_optimizer_state_dict=True))
    state = {"model": msd, "optim": osd}
    times: dict[str, list[float]] = {who: [] for who in CONTENDERS}
    for i in range(args.repeat):
        for who in turns(i):
            path = os.path.join(args.path, f"{who}{i}")
            times[who].append(_timed(lambda who=who, path=path: SAVES[who](path, state)))
    blocked, committed = _background_saves(args, state)
    return {"rank": rank, "bytes": state_bytes(state), "tensors": sum(isinstance(v, torch.Tensor) for p in state.values() for v in p.values()),
            "save": times, "bg_blocked": blocked, "bg_committed": committed, "fingerprint": fingerprint(model, optim)}


def _background_saves(args: argparse.Namespace, state: dict) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """`async_save_state_dict` against `dcp.async_save`, taking turns: the seconds training is blocked
    (barrier, the call, barrier: the slowest rank's return) and until the checkpoint is complete
    (the future's result on every rank). Each keeps what a job keeps between saves: ragckpt its
    StagingBuffers, DCP its gloo group (its default stager allocates its copies each time)."""
    import torch.distributed as dist

    import ragckpt

    keep = {"staging": ragckpt.StagingBuffers(), "group": dist.new_group(backend="gloo")}
    blocked: dict[str, list[float]] = {who: [] for who in CONTENDERS}
    committed: dict[str, list[float]] = {who: [] for who in CONTENDERS}
    for i in range(args.repeat):
        for who in turns(i):
            path = os.path.join(args.path, f"{who}-bg{i}")
            dist.barrier()
            t = time.perf_counter()
            fut = ASYNC_SAVES[who](path, state, keep)
            blocked[who].append(time.perf_counter() - t)
            fut.result()
            dist.barrier()
            committed[who].append(time.perf_counter() - t)
    return blocked, committed


def _load_role(args: argparse.Namespace, rank: int) -> dict:
    """Restore both round-one saves at --load-procs ranks into a freshly built model and optimizer,
    cold then warm, taking turns; check the first round's restores (untimed)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    opts = StateDictOptions(flatten_optimizer_state_dict=True)
    model, optim = build(args.gib, LOAD_SEED, LOAD_LR)
    get_state_dict(model, optim, options=opts)  # a fresh optimizer's state is initialised here
    with open(args.expect) as f:
        expect = json.load(f)
    times: dict[str, dict[str, list[float]]] = {k: {who: [] for who in CONTENDERS} for k in ("load", "warm_load")}
    first: tuple[str, list[torch.Tensor]] | None = None
    problems: list[str] = []

    def restore(who: str, path: str) -> float:
        poison(model, optim)
        msd, osd = get_state_dict(model, optim, options=opts)

        def run() -> None:
            LOADS[who](path, {"model": msd, "optim": osd})
            set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd, options=opts)
        return _timed(run)

    nbytes = 0
    for i in range(args.repeat):
        for who in turns(i):
            path = os.path.join(args.path, f"{who}0")
            dist.barrier()
            if rank == 0:
                drop_page_cache(path)
            times["load"][who].append(restore(who, path))
            if i == 0:  # the check, once per contender, on what the cold load restored
                msd, osd = get_state_dict(model, optim, options=opts)
                nbytes = state_bytes({"model": msd, "optim": osd})
                got = fingerprint(model, optim)
                if got != expect:
                    bad = sorted(k for k in expect if got.get(k) != expect[k]) or sorted(set(got) ^ set(expect))
                    problems.append(f"{who}: {len(bad)} tensors differ from the saved state, e.g. '{bad[0]}'")
                if any(g["lr"] != SAVE_LR for g in optim.param_groups):
                    problems.append(f"{who}: lr {optim.param_groups[0]['lr']} after the load, saved {SAVE_LR}")
                with torch.no_grad():
                    mine = [bits(t).clone() for _, t, _ in local_tensors(model, optim)]
                if first is None:
                    first = (who, mine)
                else:
                    keys = [k for k, _, _ in local_tensors(model, optim)]
                    bad = [k for k, a, b in zip(keys, first[1], mine, strict=True) if not torch.equal(a, b)]
                    if bad:
                        problems.append(f"{who} and {first[0]} restored {len(bad)} tensors differently, e.g. '{bad[0]}'")
                    first = None  # the snapshot's memory goes before the warm load
            dist.barrier()
            if rank == 0:  # into the page cache: cold restores that read with O_DIRECT leave nothing there
                read_tree(path, threads=args.load_procs)
            dist.barrier()
            times["warm_load"][who].append(restore(who, path))
    ok = torch.tensor([0 if problems else 1])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # every rank fails together, none left in a collective
    if not int(ok):
        raise SystemExit(f"rank {rank}: restores are wrong: {'; '.join(problems) or 'on another rank'}")
    return {"rank": rank, "bytes": nbytes, **times, "checked": len(expect)}


def _role(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=GLOO_TIMEOUT)
    result = _save_role(args, rank) if args.role == "save" else _load_role(args, rank)
    dist.barrier()  # nobody tears gloo down while a peer still talks to it
    dist.destroy_process_group()
    print(json.dumps(result))
    sys.stdout.flush()
    # skip C++ static destructors, which occasionally abort a process after gloo's threads (as the
    # FSDP2 test workers do): the result is printed, and an abort here would fail the whole run
    os._exit(0)


# -- driver ------------------------------------------------------------------------------------------

def _fs_of(path: str) -> str:
    """`fstype mountpoint` of the file system holding `path` (from /proc/mounts), to show that saves
    go to a disk and not to memory (tmpfs)."""
    best = ("?", "")
    try:
        with open("/proc/mounts") as f:
            for line in f:
                _, mnt, fstype, *_ = line.split()
                if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[1]):
                    best = (fstype, mnt)
    except OSError:
        pass
    return f"{best[0]} {best[1]}".strip()


def _best(results: list[dict], key: str) -> dict[str, float]:
    """Per contender: the slowest rank in each round (all ranks are timed between the same barriers),
    and the best round."""
    return {who: min(max(r[key][who][i] for r in results) for i in range(len(results[0][key][who])))
            for who in CONTENDERS}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0, help="params + Adam moments, in GiB")
    ap.add_argument("--procs", type=int, default=4, help="gloo processes that train and save")
    ap.add_argument("--load-procs", type=int, default=2, help="gloo processes that load")
    ap.add_argument("--repeat", type=int, default=2, help="rounds; each contender keeps its best time")
    ap.add_argument("--workdir", default=None, help="where to save (default: a temp dir under $TMPDIR)")
    ap.add_argument("--role", choices=["save", "load"], default=None, help=argparse.SUPPRESS)
    ap.add_argument("--path", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--expect", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.role:
        return _role(args)
    N, M = args.procs, args.load_procs
    t_start = time.perf_counter()
    root = tempfile.mkdtemp(prefix="bench-fsdp2-", dir=args.workdir)
    fs = _fs_of(os.path.realpath(root))
    if fs.startswith("tmpfs"):
        print(f"warning: {root} is on {fs}, in memory: the saves measure no disk")
    try:
        common = ["--gib", str(args.gib), "--repeat", str(args.repeat), "--path", root]
        saved = procs.run_ranks(MODULE, "save", N, common)
        t_saved = time.perf_counter() - t_start
        expect = os.path.join(root, "fingerprint.json")
        with open(expect, "w") as f:
            json.dump(saved[0]["fingerprint"], f)
        loaded = procs.run_ranks(MODULE, "load", M, [*common, "--expect", expect])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    wall = time.perf_counter() - t_start

    nbytes = saved[0]["bytes"]
    if loaded[0]["bytes"] != nbytes:
        print(f"state sizes differ: saved {nbytes} bytes, loaded {loaded[0]['bytes']}")
        return 1
    w = widths(args.gib)
    secs = {"save": _best(saved, "save"), "cold load": _best(loaded, "load"), "warm load": _best(loaded, "warm_load")}
    bg = {"blocked": _best(saved, "bg_blocked"), "complete": _best(saved, "bg_committed")}
    cols = tuple(secs)
    rates = {who: [nbytes / secs[c][who] / 1e9 for c in cols] for who in CONTENDERS}
    how = durability()
    print(f"state: {nbytes / 2**30:.2f} GiB (fp32 params + exp_avg + exp_avg_sq + steps, {saved[0]['tensors']} "
          f"tensors), {len(w) - 1} Linear layers {w[0]}..{max(w)} wide, FSDP2 over gloo; saved by {N} processes, "
          f"loaded by {M}; best of {args.repeat}; on {fs}")
    for who in CONTENDERS:
        print(f"  {who:8} save {how[who]}")
    print("  loads: get_state_dict of a fresh optimizer (untimed), then load + set_state_dict; cold = files "
          "evicted from the page cache first")
    print_rates(cols, {"ragckpt": rates["ragckpt"], "DCP": rates["dcp"]})
    print_ratios(cols, rates["ragckpt"], rates["dcp"], "ragckpt / DCP ", None)
    print("background saves (async_save_state_dict with StagingBuffers against dcp.async_save): state bytes over "
          "the seconds training is blocked, and over the seconds until the checkpoint is complete")
    bg_rates = {who: [nbytes / bg[c][who] / 1e9 for c in bg] for who in CONTENDERS}
    print_rates(tuple(bg), {"ragckpt": bg_rates["ragckpt"], "DCP": bg_rates["dcp"]})
    print_ratios(tuple(bg), bg_rates["ragckpt"], bg_rates["dcp"], "ragckpt / DCP ", None)
    print(f"checked: at {M} ranks both loads restored {loaded[0]['checked']} tensors bit for bit equal to each other "
          f"and to the {N}-rank save (exact fingerprint), and the saved lr; {wall:.0f}s in all "
          f"({t_saved:.0f}s for the save job)")
    summary = {"gib": args.gib, "state_bytes": nbytes, "procs": N, "load_procs": M, "repeat": args.repeat,
               "fs": fs, "fsync": {who: how[who].startswith("fsync: yes") for who in CONTENDERS},
               "seconds": {who: {c.replace(" ", "_"): secs[c][who] for c in cols} for who in CONTENDERS},
               "gb_per_s": {who: {c.replace(" ", "_"): g for c, g in zip(cols, rates[who], strict=True)}
                            for who in CONTENDERS},
               "ratio_vs_dcp": {c.replace(" ", "_"): a / b for c, a, b in
                                zip(cols, rates["ragckpt"], rates["dcp"], strict=True)},
               "background_seconds": {who: {c.replace(" ", "_"): bg[c][who] for c in bg} for who in CONTENDERS},
               "checked_tensors": loaded[0]["checked"], "wall_seconds": wall}
    print(json.dumps({"bench_fsdp2": summary}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

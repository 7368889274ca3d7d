"""A training job under `ragfsdp.Checkpointer`, run as real processes that a test can SIGKILL.

`launch` forks `world` gloo ranks (fork keeps the start cheap: torch is imported once, in the test)
and returns the processes, so a test can kill any of them at a point the worker announces with a
marker file. One launch runs a list of phases (a reference run, a checkpointed run, a resume...) so
that the few seconds a gloo job costs to start are paid once for several cases.

Test hooks (deterministic, no sleeps to race against), set per phase:
- `block_step`/`block_rank`: that rank's background write of that step finishes, then the writer
  thread announces `blocked.rank<r>` and blocks for good: the save is in flight when the test kills;
  every other rank announces `written.rank<r>` once its own write of that step is done.
- `file_at_step`: rank 0 puts a plain file where that step's checkpoint directory must go, before
  training, so that save fails in the store on every rank (the destination is unwritable).
- `gate_step`: every rank's write of that step, once done, waits for the test to create `release`
  (with `announce_wait`, each rank announces `waiting.rank<r>` when its loop is done).
- `hold`: after the last step (its save committed), every rank announces `held.rank<r>` and sleeps
  until it is killed.
"""

from __future__ import annotations

import logging
import os
import pickle
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import ragckpt
import ragfsdp
from ragfsdp.autockpt import Checkpointer, CheckpointSaveError
from tests.engine.dist_helpers import load_result

LR = 0.05
D = 64  # the middle layer's weight has D * D = 4096 elements: Adam8bit's quantized path


class Net(nn.Module):
    """Small, with dropout so the per-rank RNG restore of a resume is exercised."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.inp = nn.Linear(7, D)
        self.mid = nn.Linear(D, D)
        self.head = nn.Linear(D, 5)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.drop(nn.functional.gelu(self.inp(x)))
        return self.head(nn.functional.gelu(self.mid(x)))


def batch(step: int, rank: int, world: int, n: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of `step`, the same at every world size dividing `n`, and this rank's slice."""
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(n, 7, generator=g), torch.randn(n, 5, generator=g)
    k = n // world
    return x[rank * k:(rank + 1) * k], y[rank * k:(rank + 1) * k]


class ShardSGD:
    """A stateless update of the shards: the optimizer-free case of a checkpoint (weights only)."""

    def __init__(self, model: nn.Module) -> None:
        self.groups = ragfsdp.flat_groups(model)

    def step(self) -> None:
        with torch.no_grad():
            for g in self.groups:
                g.shard.sub_(LR * g.grad)

    def zero_grad(self) -> None:
        for g in self.groups:
            g.grad = None


def optimizer_class(kind: str) -> Any:
    """`ragfsdp.optim.AdamW` / `ragfsdp.optim.Adam8bit` (from its module while the package does not
    export it yet); None where it does not exist."""
    import importlib

    name = {"adamw": "AdamW", "adam8bit": "Adam8bit"}[kind]
    ro = importlib.import_module("ragfsdp.optim")
    if hasattr(ro, name):
        return getattr(ro, name)
    try:
        return getattr(importlib.import_module(f"ragfsdp.optim.{kind}"), name, None)
    except ImportError:
        return None


def build(opt_kind: str, dropout: float) -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    model = Net(dropout)
    cls = None if opt_kind == "sgd" else optimizer_class(opt_kind)
    granularity = getattr(cls, "granularity", None)
    ragfsdp.fully_shard(model.mid, granularity=granularity)
    ragfsdp.fully_shard(model, granularity=granularity)
    if cls is None:
        return model, ShardSGD(model)
    return model, cls(model, lr=1e-2, weight_decay=0.01)


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter rebuilt from all ranks' pieces (a collective)."""
    mine = []
    for g in ragfsdp.flat_groups(model):
        for pc in g.pieces():
            mine.append((pc.name, pc.flat_start, g.shard[pc.offset:pc.offset + pc.length].clone()))
    shapes = {n: s for g in ragfsdp.flat_groups(model) for n, s in zip(g.param_names, g.shapes, strict=True)}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    out = {n: torch.zeros(torch.Size(s).numel()) for n, s in shapes.items()}
    for pieces in everyone:
        for name, start, vals in pieces:
            out[name][start:start + vals.numel()] = vals
    return {n: t.view(shapes[n]) for n, t in out.items()}


def _announce(work: Path, name: str) -> None:
    tmp = work / f".{name}.tmp"
    tmp.write_text("1")
    os.replace(tmp, work / name)


def _install_block(work: Path, rank: int, step: int, block_rank: int) -> None:
    """Wrap `ragckpt.save_shard_async` (as the checkpointer calls it) for the save of `step`."""
    real = ragckpt.save_shard_async

    def wrapped(url: str, *a: Any, **k: Any) -> Any:
        fut = real(url, *a, **k)
        if ragckpt.step_of(url) != step:
            return fut

        class Held:
            def result(self, timeout: float | None = None) -> dict:
                rec = fut.result()
                if rank == block_rank:
                    _announce(work, f"blocked.rank{rank}")
                    threading.Event().wait()  # until SIGKILL
                _announce(work, f"written.rank{rank}")
                return rec
        return Held()

    ragckpt.save_shard_async = wrapped


def _install_gate(work: Path, rank: int, step: int) -> None:
    """Hold every rank's write of `step` (once done) until the test creates `release`."""
    real = ragckpt.save_shard_async

    def wrapped(url: str, *a: Any, **k: Any) -> Any:
        fut = real(url, *a, **k)
        if ragckpt.step_of(url) != step:
            return fut

        class Gated:
            def result(self, timeout: float | None = None) -> dict:
                rec = fut.result()
                _announce(work, f"gated.rank{rank}")
                while not (work / "release").exists():
                    time.sleep(0.01)
                return rec
        return Gated()

    ragckpt.save_shard_async = wrapped


def run_phase(rank: int, world: int, work: Path, ph: dict) -> dict:
    """One training run: fresh or resumed, to step `last`, optionally checkpointed under `root`."""
    model, opt = build(ph.get("opt", "sgd"), ph.get("dropout", 0.0))
    ck_opt = None if isinstance(opt, ShardSGD) else opt
    root = ph.get("root")
    ck = None
    if root is not None:
        if ph.get("file_at_step") is not None and rank == 0:
            os.makedirs(root, exist_ok=True)
            Path(root, f"step-{ph['file_at_step']}").write_text("a file where the checkpoint must go")
        dist.barrier()
        ck = Checkpointer(root, every_steps=ph.get("every"), keep_last=ph.get("keep_last"),
                          async_save=ph.get("async_save", True), seed=7)
    torch.manual_seed(100 + rank)  # the per-rank dropout stream of a fresh run
    if ph.get("listing_fails_on_rank0"):  # the store fails rank 0's listing: every rank must hear of it
        real = ragckpt.list_checkpoints
        if rank == 0:
            ragckpt.list_checkpoints = _failing_listing
        try:
            ck.resume(model, ck_opt)
        except ragckpt.RagckptError as e:
            return {"resume_error": str(e)}
        finally:
            ragckpt.list_checkpoints = real
            ck.close()
        return {"resume_error": None}
    start = ck.resume(model, ck_opt, from_url=ph.get("from_url")) if ck is not None and ph.get("resume") else 0
    out: dict = {"start": start, "losses": [], "errors": [], "listings": {}}
    for step in range(start + 1, ph["last"] + 1):
        x, y = batch(step, rank, world)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        out["losses"].append(total.item() / world)
        if ck is None:
            continue
        try:
            ck.maybe_save(step, model, ck_opt, extra={"data_position": step * 12})
        except CheckpointSaveError as e:
            out["errors"].append((step, str(e)))
            # what is committed at the moment the failure is seen: nothing may have gone
            out["listings"][step] = _committed_steps(root)
    if ck is not None:
        if ph.get("announce_wait"):  # the loop is done; the save of its last step may still be writing
            _announce(work, f"waiting.rank{rank}")
        try:
            ck.wait()
        except CheckpointSaveError as e:
            out["errors"].append((ph["last"], str(e)))
        out["last_committed"] = ck.last_committed
        out["resumed_extra"] = ck.resumed_extra
        ck.close()
    if not ph.get("no_params"):  # a collective: not after a peer was killed
        out["params"] = full_params(model)
    if ph.get("hold"):
        _write_atomic(work / f"held.rank{rank}.pkl", pickle.dumps(out))
        _announce(work, f"held.rank{rank}")
        threading.Event().wait()  # until SIGKILL
    return out


def _failing_listing(url: str, **_: Any) -> list[dict]:
    raise ragckpt.StorageError(f"injected: listing {url} timed out")


def _committed_steps(root: str) -> list[int]:
    return sorted(ragckpt.step_of(r["url"]) for r in ragckpt.list_checkpoints(root) if r["committed"])


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _entry(rank: int, world: int, work: str, phases: list[dict], tag: str) -> None:
    torch.set_num_threads(1)
    wd = Path(work)
    logging.basicConfig(filename=str(wd / f"{tag}.rank{rank}.log"), level=logging.INFO,
                        format="%(name)s %(levelname)s %(message)s", force=True)
    dist.init_process_group("gloo", init_method=f"file://{work}/rdzv-{tag}", rank=rank, world_size=world)
    results = []
    try:
        for ph in phases:
            if ph.get("block_step") is not None:
                _install_block(wd, rank, ph["block_step"], ph["block_rank"])
            if ph.get("gate_step") is not None:
                _install_gate(wd, rank, ph["gate_step"])
            results.append(run_phase(rank, world, wd, ph))
            # after every phase: a rank killed in a later one still leaves the earlier ones' results
            _write_atomic(wd / f"{tag}.rank{rank}.pkl", pickle.dumps(("ok", results)))
    except BaseException:
        _write_atomic(wd / f"{tag}.rank{rank}.pkl", pickle.dumps(("error", traceback.format_exc())))
        raise
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a peer that was killed leaves the group unusable
            pass


_WARM: set[str] = set()


def _prewarm(kinds: set[str]) -> None:
    """Build each model/optimizer once in the parent: the first build imports what torch loads
    lazily (torch._dynamo, 1.5 s of CPU), which every forked rank would otherwise import again."""
    for kind in sorted(kinds - _WARM):
        build(kind, 0.0)
        _WARM.add(kind)


def launch(world: int, work: Path, phases: list[dict], tag: str) -> list[Any]:
    """Start the job; returns its processes (mp.Process: `.pid` to kill, `.join`, `.exitcode`)."""
    _prewarm({ph.get("opt", "sgd") for ph in phases})
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_entry, args=(r, world, str(work), phases, tag), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    return procs


def wait_for(work: Path, names: list[str], procs: list[Any], timeout: float = 60.0) -> None:
    """Until every marker in `names` exists; fails early when a rank died instead."""
    deadline = time.monotonic() + timeout
    while not all((work / n).exists() for n in names):
        dead = [p for p in procs if p.exitcode is not None]
        if dead:
            raise AssertionError(f"a rank exited ({dead[0].exitcode}) before {names}: {collect_errors(work)}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {names}")
        time.sleep(0.02)


def held(work: Path, rank: int) -> dict:
    """The results of the phase rank `rank` was held (and killed) in."""
    return pickle.loads((work / f"held.rank{rank}.pkl").read_bytes())


def collect_errors(work: Path) -> str:
    msgs = []
    for f in sorted(work.glob("*.rank*.pkl")):
        if f.name.startswith("held."):
            continue
        status, res = pickle.loads(f.read_bytes())
        if status != "ok":
            msgs.append(f"{f.name}:\n{res}")
    return "\n".join(msgs)


def results(work: Path, tag: str, world: int, procs: list[Any], timeout: float = 120.0) -> list[list[dict]]:
    """Join the job and return each rank's list of phase results (a rank's failure raised with its traceback)."""
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    if any(p.is_alive() for p in procs):
        for p in procs:
            if p.is_alive():
                p.kill()
        raise AssertionError(f"{tag}: a rank did not finish in {timeout} s")
    return read_results(work, tag, world, procs)


def read_results(work: Path, tag: str, world: int, procs: list[Any]) -> list[list[dict]]:
    """What each rank wrote (the phases it finished), without waiting for it to exit."""
    return [load_result(work / f"{tag}.rank{r}.pkl", f"{tag}: rank {r}", f" (exit code {procs[r].exitcode})")
            for r in range(world)]


def log_of(work: Path, tag: str, rank: int = 0) -> str:
    return (work / f"{tag}.rank{rank}.log").read_text()


__all__ = ["batch", "build", "optimizer_class", "collect_errors", "held", "launch", "log_of", "read_results", "results", "run_phase", "wait_for"]

"""Run a function on W gloo ranks (forked processes, file:// rendezvous in a test's tmp dir)."""

from __future__ import annotations

import os
import pickle
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, fn: Callable, world: int, tmp: str, args: tuple) -> None:
    torch.set_num_threads(1)
    out = Path(tmp) / f"result.{rank}.pkl"
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world)
    try:
        res = fn(rank, world, *args)
        out.write_bytes(pickle.dumps(("ok", res)))
    except BaseException:
        out.write_bytes(pickle.dumps(("error", traceback.format_exc())))
        raise
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable, world: int, tmp_path: Path, *args: object) -> list:
    """`fn(rank, world, *args)` on every rank; returns the ranks' results (a failure re-raised with its traceback)."""
    tmp = tmp_path / f"dist{world}.{os.getpid()}.{len(list(tmp_path.iterdir()))}"
    tmp.mkdir()
    try:
        mp.start_processes(_entry, args=(fn, world, str(tmp), args), nprocs=world, start_method="fork")
    except Exception:
        pass
    return [load_result(tmp / f"result.{r}.pkl", f"rank {r}") for r in range(world)]


def load_result(f: Path, who: str, missing_detail: str = "") -> object:
    """What a rank's process left in `f` as ("ok", result) or ("error", traceback): the result, or an
    AssertionError naming `who` (with its traceback, or `missing_detail` when it left nothing)."""
    if not f.exists():
        raise AssertionError(f"{who} left no result{missing_detail}")
    status, res = pickle.loads(f.read_bytes())
    if status != "ok":
        raise AssertionError(f"{who} failed:\n{res}")
    return res

"""Multi-process FSDP2 (CPU, gloo) half of tests/integrations/test_state_dict_fsdp2.py.

    python tests/state_dict_fsdp2_worker.py save WORK PORT NPROCS
        trains dcp_fsdp_worker's TinyNet a few Adam steps, saves model + optimizer with
        `save_state_dict` into WORK/ckpt, and writes the reference WORK/ref.pt (every tensor's
        `full_tensor()`, the hyperparameters, each parameter's local row count), saves the same state
        with `async_save_state_dict` into WORK/async while an Adam step changes it. Then makes saves fail
        on one rank at each phase and writes what every rank raised to WORK/errors.pt.
    python tests/state_dict_fsdp2_worker.py load WORK PORT NPROCS LABEL=KIND:PATH ...
        for each source, builds a fresh FSDP2 model and optimizer (other seed, other lr), fills them
        with `load_state_dict` (KIND ragckpt) or stock `dcp.load` (KIND dcp) and `set_state_dict`, and
        writes what they then hold, in the reference's form, to WORK/got.pt as {LABEL: record}; then
        loads the first source with the optimizer on rank 0 alone and records what each rank raised
        under "mixed".
"""

from __future__ import annotations

import datetime
import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from dcp_fsdp_worker import OPTS, build, gloo_worker, record, train
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import ragckpt
import ragckpt.integrations.fsdp2 as sd
from ragckpt.errors import FormatError


def outcome(fn: object) -> tuple[str | None, str]:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test compares what every rank saw
        return type(e).__name__, str(e)
    return None, ""


def failing_saves(work: str, rank: int, msd: dict, osd: dict) -> dict[str, list]:
    """One failure per phase, each on one rank only; returns {case: [what each rank raised]}."""
    def save(case: str, state: dict) -> tuple[str | None, str]:
        return outcome(lambda: sd.save_state_dict(f"{work}/err_{case}", state))

    mine = {
        # phase 1 on rank 2 alone: a tensor without data
        "meta": save("meta", {"model": {**msd, **({"junk": torch.empty(3, device="meta")} if rank == 2 else {})},
                              "optim": osd}),
        # phase 1 everywhere fine, but rank 1's structure is not rank 0's
        "differs": save("differs", {"model": {**msd, **({"junk": torch.zeros(2)} if rank == 1 else {})},
                                    "optim": osd}),
        # or rank 2's entry has another shape
        "shape": save("shape", {"model": {**msd, "junk": torch.zeros(3 if rank == 2 else 2)}, "optim": osd}),
        # phase 2: every rank refuses to write into a committed checkpoint
        "committed": outcome(lambda: sd.save_state_dict(f"{work}/ckpt", {"model": msd, "optim": osd})),
        # rank 1 alone passes overwrite=True: the collectives of the two paths paired up wrongly (a hang)
        "overwrite_differs": outcome(lambda: sd.save_state_dict(f"{work}/ckpt", {"model": msd, "optim": osd},
                                                                overwrite=rank == 1)),
        "async_overwrite_differs": outcome(sd.async_save_state_dict(f"{work}/ckpt", {"model": msd, "optim": osd},
                                                                    overwrite=rank == 2).result),
    }
    real = sd.commit
    if rank == 0:  # phase 3: rank 0's commit fails
        def broken(*_a: object, **_k: object) -> None:
            raise FormatError("injected commit failure")
        sd.commit = broken
    mine["commit"] = save("commit", {"model": msd, "optim": osd})
    sd.commit = real
    # a buffer each rank keeps its own way (an EMA, BatchNorm statistics without SyncBN): saved as
    # rank 0 holds it, with a warning on rank 0, never as a patchwork of every rank's rows
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sd.save_state_dict(f"{work}/divergent", {"model": {**msd, "ema": torch.arange(8.0) + 100 * rank}, "optim": osd})
    mine["divergent"] = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    mine["divergent_ema"] = ragckpt.open(f"{work}/divergent").read("ema")
    # saved again into the same directory, as a job saving into "latest" does
    sd.save_state_dict(f"{work}/divergent", {"model": {**msd, "ema": torch.arange(8.0) - 1}, "optim": osd},
                       overwrite=True)
    # an overwrite that fails (rank 0's commit, then, in the background, rank 1's write): once the call
    # or future has raised, every rank finds the previous checkpoint back in place
    again = {"model": {**msd, "ema": torch.arange(8.0) + 5}, "optim": osd}
    if rank == 0:
        sd.commit = broken
    mine["overwrite_fails"] = outcome(lambda: sd.save_state_dict(f"{work}/divergent", again, overwrite=True))
    sd.commit = real
    mine["after_rollback"] = ragckpt.open(f"{work}/divergent").read("ema")
    real_save = sd.save_shard

    def write_fails_on_rank_1(*a: object, **k: object) -> dict:
        if rank == 1:
            raise OSError("injected: disk full")
        return real_save(*a, **k)

    sd.save_shard = write_fails_on_rank_1
    fut = sd.async_save_state_dict(f"{work}/divergent", again, overwrite=True)
    mine["overwrite_fails_async"] = outcome(fut.result)
    sd.save_shard = real_save
    mine["after_rollback_async"] = ragckpt.open(f"{work}/divergent").read("ema")
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {case: [r[case] for r in everyone] for case in mine}


def background_cases(work: str, rank: int, msd: dict, osd: dict) -> dict[str, list]:
    """Background saves when one rank fails to copy its shards, over a group in another rank order,
    and the timeout their gloo group inherits; returns {case: [what each rank saw]} like failing_saves."""
    state = {"model": msd, "optim": osd}
    real = sd._rank_buffers

    def copy_fails_on_rank_1(*a: object, **k: object) -> dict:
        if rank == 1:
            raise MemoryError("injected: no host memory for the staging copy")
        return real(*a, **k)

    mine: dict = {}
    sd._rank_buffers = copy_fails_on_rank_1
    fut = sd.async_save_state_dict(f"{work}/err_staging_async", state)  # returns on rank 1 too
    sd._rank_buffers = real
    mine["staging_async"] = outcome(fut.result)
    # the next save pairs up with the same save on every rank: the writers stayed in step
    mine["after_staging"] = outcome(sd.async_save_state_dict(f"{work}/after_staging", state).result)
    sd._rank_buffers = copy_fails_on_rank_1
    mine["staging_sync"] = outcome(lambda: sd.save_state_dict(f"{work}/err_staging_sync", state))
    sd._rank_buffers = real
    # a group listing the ranks in another order than the world's: documents and checksums keyed right
    order = dist.new_group([1, 0, 2], sort_ranks=False)
    plain = {"w": torch.arange(30.0).reshape(10, 3), "v": torch.arange(7, dtype=torch.int64)}
    # the ranks created different numbers of groups (new_group([0]) above): they cannot make their
    # own background group for a subgroup; told so on every rank, instead of a hang
    mine["own_group"] = outcome(lambda: sd.async_save_state_dict(f"{work}/err_own_group", plain, group=order))
    made = dist.new_group([1, 0, 2], backend="gloo", sort_ranks=False)
    mine["unsorted"] = outcome(sd.async_save_state_dict(f"{work}/unsorted", plain, group=order,
                                                        background_group=made).result)
    # the ranks compare their state dicts in the writer thread: a rank whose own checks fail raises at
    # the call, the others from their futures; a structure that differs fails every future
    junk = {"model": {**msd, **({"junk": torch.empty(3, device="meta")} if rank == 2 else {})}, "optim": osd}
    try:
        fut = sd.async_save_state_dict(f"{work}/err_async_meta", junk)
        mine["async_meta"] = ("future",) + outcome(fut.result)
    except Exception as e:  # noqa: BLE001
        mine["async_meta"] = ("call", type(e).__name__, str(e))
    extra = {"model": {**msd, **({"junk": torch.zeros(2)} if rank == 1 else {})}, "optim": osd}
    mine["async_differs"] = outcome(sd.async_save_state_dict(f"{work}/err_async_differs", extra).result)
    # replicated copies that differ: rank 0's copy as it was at the call, though it changes right after
    ema = torch.arange(8.0) + 100 * rank
    fut = sd.async_save_state_dict(f"{work}/async_divergent", {"model": {**msd, "ema": ema}, "optim": osd})
    ema.fill_(-7.0)
    mine["async_divergent"] = outcome(fut.result)
    # with warnings turned into errors, rank 0's warning about them comes after every collective: it
    # fails rank 0's future alone, and the next save still pairs up
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fut = sd.async_save_state_dict(f"{work}/async_divergent_strict", {"model": {**msd, "ema": ema + rank},
                                                                          "optim": osd})
        mine["strict_warning"] = outcome(fut.result)
    mine["after_strict"] = outcome(sd.async_save_state_dict(f"{work}/after_strict", state).result)
    bg = sd._background_groups[(0, 1, 2)][1]
    mine["timeout"] = [sd._group_timeout(bg).total_seconds(), sd._group_timeout(None).total_seconds()]
    return mine


def load_one(kind: str, path: str) -> dict:
    model, opt = build(seed=123, lr=5e-4)
    msd, osd = get_state_dict(model, opt, options=OPTS)
    if kind == "ragckpt":
        sd.load_state_dict(path, {"model": msd, "optim": osd})
    else:
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd, options=OPTS)
    rec = record(model, opt, {})
    rec["local_rows"] = {n: int(p.to_local().shape[0]) for n, p in model.named_parameters()}
    return rec


def mixed_load(path: str, rank: int, world: int) -> list:
    """Rank 0 asks for model and optimizer, every other rank for the model alone: refused on every
    rank before anything is read. Returns what each rank raised and whether its model was untouched."""
    model, opt = build(seed=123, lr=5e-4)
    msd, osd = get_state_dict(model, opt, options=OPTS)
    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    before = {k: local(v).clone() for k, v in msd.items()}
    kind, text = outcome(lambda: sd.load_state_dict(path, {"model": msd, "optim": osd} if rank == 0 else {"model": msd}))
    untouched = all(torch.equal(local(v), before[k]) for k, v in msd.items())
    seen: list = [None] * world
    dist.all_gather_object(seen, (kind, text, untouched))
    return seen


@gloo_worker
def run(rank: int, world: int, port: int, mode: str, work: str, sources: list[str]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # a lost rank would otherwise hang the test for gloo's 30 minutes
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    if mode == "save":
        model, opt = train(rank)
        msd, osd = get_state_dict(model, opt, options=OPTS)
        sd.save_state_dict(f"{work}/ckpt", {"model": msd, "optim": osd}, save_id="test")
        rec = record(model, opt, {})
        rec["local_rows"] = {n: int(p.to_local().shape[0]) for n, p in model.named_parameters()}
        # the same state saved in the background while training goes on: the Adam step below rewrites
        # every parameter and moment (the very memory msd and osd point at) before the save is done
        dist.new_group([0])  # every rank calls it, rank 0 alone is in it: the ranks now hold unequal group counts
        fut = sd.async_save_state_dict(f"{work}/async", {"model": msd, "optim": osd}, save_id="async",
                                       staging=ragckpt.StagingBuffers())
        model(torch.randn(4, 13, generator=torch.Generator().manual_seed(7))).pow(2).mean().backward()
        opt.step()
        fut.result()
        errs = failing_saves(work, rank, msd, osd)
        more: list = [None] * world
        dist.all_gather_object(more, background_cases(work, rank, msd, osd))
        errs.update({case: [r[case] for r in more] for case in more[0]})
        if rank == 0:
            torch.save(rec, f"{work}/ref.pt")
            torch.save(errs, f"{work}/errors.pt")
    else:
        got = {}
        for src in sources:
            label, _, rest = src.partition("=")
            kind, _, path = rest.partition(":")
            got[label] = load_one(kind, path)
        got["mixed"] = mixed_load(sources[0].partition(":")[2], rank, world)
        if rank == 0:
            torch.save(got, f"{work}/got.pt")


if __name__ == "__main__":
    mode, work, port, nprocs = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    mp.spawn(run, args=(nprocs, port, mode, work, sys.argv[5:]), nprocs=nprocs)

"""Two jobs saving into one directory at once, as real processes forced to overlap.

Each job is a forked process that runs `save_shard` for ranks of an 8-rank checkpoint and then
`commit`, with and without `save_id`, in interleavings fixed by events (a job waits for the other
to reach a step): the property checked after every trial is that no commit ever makes a checkpoint
of both, and that a committed one verifies and holds, bit for bit, the winning job's data and user
metadata (compared against the tensor the job was given).
"""

from __future__ import annotations

import multiprocessing as mp
import traceback

import pytest
import torch

import ragckpt
from ragckpt.checkpoint.writer import SaveConflictError
from tests.helpers import assert_bit_equal

W = 8
SHAPE = (16, 3)
_CTX = mp.get_context("fork")


def _layout() -> ragckpt.CheckpointLayout:
    return ragckpt.CheckpointLayout.build({"w": (SHAPE, "float32")}, W, "row")


def _state(job: str) -> torch.Tensor:
    """Each job's tensor: different in every element, so any rank of the other job shows."""
    base = torch.arange(SHAPE[0] * SHAPE[1], dtype=torch.float32).reshape(SHAPE)
    return base + 1 if job == "A" else -base - 1000


def _rank_buffer(job: str, rank: int) -> torch.Tensor:
    sizes = _layout().rank_sizes(0)
    start = int(sizes[:rank].sum())
    return _state(job).reshape(-1)[start : start + int(sizes[rank])].clone()


def _job(job: str, url: str, opts: dict | None, steps: list[tuple], events: dict, out: mp.Queue,
         save_id: str | None) -> None:
    """Run `steps`: ("save", ranks), ("set", event), ("wait", event), ("commit",). Reports
    ("committed", None) or ("failed", the exception's type and message) on `out`."""
    lay = _layout()
    try:
        for step in steps:
            if step[0] == "save":
                for r in step[1]:
                    ragckpt.save_shard(url, r, {"float32": _rank_buffer(job, r)}, lay, user={"job": job},
                                       storage_options=opts, save_id=save_id)
            elif step[0] == "set":
                events[step[1]].set()
            elif step[0] == "wait":
                assert events[step[1]].wait(30), f"job {job} timed out waiting for {step[1]}"
            else:
                ragckpt.commit(url, storage_options=opts)
        out.put((job, "committed", None, None))
    except ragckpt.RagckptError as e:
        out.put((job, "failed", type(e).__name__, str(e)))
    except BaseException:  # noqa: BLE001 - anything else is a test failure, reported to the parent
        out.put((job, "crashed", None, traceback.format_exc()))
    finally:
        for ev in events.values():  # never leave the other job waiting on a step this one skipped
            ev.set()


def _race(url: str, opts: dict | None, steps: dict[str, list[tuple]], ids: dict[str, str | None]) -> dict:
    names = {s[1] for job in steps.values() for s in job if s[0] in ("set", "wait")}
    events = {n: _CTX.Event() for n in names}
    out = _CTX.Queue()
    procs = [_CTX.Process(target=_job, args=(j, url, opts, steps[j], events, out, ids[j])) for j in steps]
    for p in procs:
        p.start()
    results = {}
    for _ in procs:
        job, outcome, kind, msg = out.get(timeout=60)
        results[job] = (outcome, kind, msg)
    for p in procs:
        p.join(30)
    return results


def _check_trial(url: str, opts: dict | None, results: dict) -> str | None:
    """At most one job committed; a loser failed with one line; a committed checkpoint verifies
    and is all the winner's. Returns the winner."""
    assert not [r for r in results.values() if r[0] == "crashed"], results
    winners = [j for j, r in results.items() if r[0] == "committed"]
    assert len(winners) <= 1, results
    for j, (outcome, _, msg) in results.items():
        if outcome == "failed":
            assert "\n" not in msg and url in msg, (j, msg)
    if not winners:
        with pytest.raises(ragckpt.NotCommittedError):
            ragckpt.open(url, storage_options=opts)
        return None
    ck = ragckpt.open(url, storage_options=opts)
    assert ck.verify().ok
    assert_bit_equal(ck.read("w"), _state(winners[0]))
    for r in range(W):
        assert_bit_equal(ck.read_local("w", r).reshape(-1), _rank_buffer(winners[0], r))
    assert ck.user == {"job": winners[0]}
    return winners[0]


ALL = list(range(W))
#: A saves half, B saves everything, then A the other half; both commit
INTERLEAVED = {"A": [("save", ALL[:4]), ("set", "a_half"), ("wait", "b_saved"), ("save", ALL[4:]), ("set", "a_saved"),
                     ("commit",)],
               "B": [("wait", "a_half"), ("save", ALL), ("set", "b_saved"), ("wait", "a_saved"), ("commit",)]}
#: A has saved every rank and commits while B has saved half of them; B then finishes and commits
COMMIT_MID_SAVE = {"A": [("save", ALL), ("set", "a_saved"), ("wait", "b_half"), ("commit",), ("set", "a_done")],
                   "B": [("wait", "a_saved"), ("save", ALL[:4]), ("set", "b_half"), ("wait", "a_done"),
                         ("save", ALL[4:]), ("commit",)]}
#: both start at once and run freely
FREE = {"A": [("set", "a_go"), ("wait", "b_go"), ("save", ALL), ("commit",)],
        "B": [("set", "b_go"), ("wait", "a_go"), ("save", ALL), ("commit",)]}

IDS = {"no save_id": {"A": None, "B": None}, "distinct save_ids": {"A": "step5-jobA", "B": "step5-jobB"}}


@pytest.mark.parametrize("ids", list(IDS), ids=list(IDS))
def test_interleaved_saves_never_commit_a_mix(tmp_path, ids):
    """The issue's case: A saves ranks 0-3, B saves 0-7, A saves 4-7, both commit. Without an
    identity, B committed its metadata over A's ranks 4-7 (verify OK). Both commits now see records
    of two saves and refuse, naming the destination and the conflicting save."""
    url = str(tmp_path / "ck")
    results = _race(url, None, INTERLEAVED, IDS[ids])
    assert _check_trial(url, None, results) is None
    for _, kind, msg in results.values():
        assert kind == "SaveConflictError" and "two saves wrote into" in msg, msg


@pytest.mark.parametrize("ids", list(IDS), ids=list(IDS))
def test_a_commit_while_another_job_rewrites_half_the_ranks_is_refused_and_the_other_job_wins(tmp_path, ids):
    url = str(tmp_path / "ck")
    results = _race(url, None, COMMIT_MID_SAVE, IDS[ids])
    assert _check_trial(url, None, results) == "B"
    assert results["A"][1] == "SaveConflictError", results


@pytest.mark.parametrize("ids", list(IDS), ids=list(IDS))
def test_free_running_races_never_commit_a_mix(tmp_path, ids):
    for trial in range(3):
        url = str(tmp_path / f"ck{trial}")
        _check_trial(url, None, _race(url, None, FREE, IDS[ids]))


def test_racing_saves_on_s3(s3):
    for trial, (steps, ids) in enumerate([(INTERLEAVED, "no save_id"), (COMMIT_MID_SAVE, "no save_id"),
                                          (FREE, "distinct save_ids")]):
        url = f"{s3.url}/ck{trial}"
        winner = _check_trial(url, s3.storage_options, _race(url, s3.storage_options, steps, IDS[ids]))
        assert winner == {0: None, 1: "B"}.get(trial, winner)


def test_ranks_of_one_job_in_separate_processes_agree_through_the_job_token(tmp_path, monkeypatch):
    """Without save_id, ranks in separate processes share an identity through their job's token
    (here RAGCKPT_JOB_TOKEN; torchrun's run id or MASTER_ADDR:MASTER_PORT in a real job), so one
    job's ranks saved by different processes commit; with no token at all they differ, and the
    commit refuses instead of guessing."""
    url = str(tmp_path / "ck")
    monkeypatch.setenv("RAGCKPT_JOB_TOKEN", "job-42")
    for k in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "MASTER_ADDR"):
        monkeypatch.delenv(k, raising=False)
    steps = {"A": [("save", ALL[:4]), ("set", "half")], "B": [("wait", "half"), ("save", ALL[4:]), ("commit",)]}
    results = _race(url, None, steps, IDS["no save_id"])
    assert results["B"][0] == "committed", results
    ck = ragckpt.open(url)
    assert ck.verify().ok
    # the two processes are one job's ranks here: 0-3 from the first, 4-7 from the second
    for r in range(W):
        assert_bit_equal(ck.read_local("w", r).reshape(-1), _rank_buffer("A" if r < 4 else "B", r))
    assert ck.user == {"job": "A"}
    url2 = str(tmp_path / "ck2")
    monkeypatch.delenv("RAGCKPT_JOB_TOKEN")
    results = _race(url2, None, steps, IDS["no save_id"])
    assert results["B"][1] == "SaveConflictError", results
    with pytest.raises(SaveConflictError, match="of save 'auto-"):
        ragckpt.commit(url2)

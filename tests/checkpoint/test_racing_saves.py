"""Two jobs saving into one directory at once, as real processes forced to overlap.

Each job runs `save_shard` for the ranks of one checkpoint and then `commit`, with and without
`save_id`: either as one process per job in interleavings fixed by events (a job waits for the
other to reach a step), or as one process per rank, both jobs' ranks released at once. Checked
after every trial: exactly one job commits, the other fails with one line naming the directory;
the committed checkpoint verifies and holds, bit for bit, the winner's tensors, extras and user
metadata; and the loser's ranks saving again after the commit change no byte of it.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import traceback

import pytest
import torch

import ragckpt
from ragckpt.checkpoint.writer import SaveConflictError, save_identity
from ragckpt.storage.lock import CLAIM_SUFFIX, claim_url
from ragckpt.storage.store import open_store
from tests.helpers import assert_bit_equal

W = 8
SHAPES = {"w": (16, 3), "b": (10,)}
DTYPES = {"w": torch.float32, "b": torch.bfloat16}
_CTX = mp.get_context("fork")


def _layout(world: int = W) -> ragckpt.CheckpointLayout:
    return ragckpt.CheckpointLayout.build({"w": (SHAPES["w"], "float32"), "b": (SHAPES["b"], "bfloat16")}, world,
                                          "row")


def _state(job: str, name: str) -> torch.Tensor:
    """Each job's tensor: different in every element, so any rank of the other job shows."""
    n = torch.Size(SHAPES[name]).numel()
    base = torch.arange(n, dtype=torch.float32).reshape(SHAPES[name])
    return (base + 1 if job == "A" else -base - 1000).to(DTYPES[name])


def _rank_buffers(job: str, rank: int, world: int = W) -> dict[str, torch.Tensor]:
    lay = _layout(world)
    out = {}
    for bi, spec in enumerate(lay.buffers):
        (name,) = spec.tensors
        sizes = lay.rank_sizes(bi)
        start = int(sizes[:rank].sum())
        out[spec.name] = _state(job, name).reshape(-1)[start : start + int(sizes[rank])].clone()
    return out


def _extra(job: str, rank: int) -> dict[str, torch.Tensor]:
    return {"rng": torch.tensor([ord(job), rank])}


def _save(job: str, url: str, opts: dict | None, rank: int, save_id: str | None, world: int = W) -> dict:
    return ragckpt.save_shard(url, rank, _rank_buffers(job, rank, world), _layout(world), extra=_extra(job, rank),
                              user={"job": job}, storage_options=opts, save_id=save_id)


def _report(out: mp.Queue, key: tuple, fn) -> None:
    """Run `fn` and put (key..., outcome, detail) on `out`: ("ok", its result), ("failed", the
    exception's type and one-line message), or ("crashed", a traceback: a test failure)."""
    try:
        out.put((*key, "ok", fn()))
    except ragckpt.RagckptError as e:
        out.put((*key, "failed", (type(e).__name__, str(e))))
    except BaseException:  # noqa: BLE001 - anything else is a test failure, reported to the parent
        out.put((*key, "crashed", traceback.format_exc()))


# -- one process per job, in fixed interleavings ---------------------------------------------------------

def _job(job: str, url: str, opts: dict | None, steps: list[tuple], events: dict, out: mp.Queue,
         save_id: str | None) -> None:
    """Run `steps`: ("save", ranks), ("set", event), ("wait", event), ("commit",), then report."""
    os.environ["RAGCKPT_JOB_TOKEN"] = f"job-{job}-{url}"  # what torchrun or Slurm gives a job's ranks

    def run() -> None:
        records = {}
        for step in steps:
            if step[0] == "save":
                for r in step[1]:
                    records[r] = _save(job, url, opts, r, save_id)
            elif step[0] == "set":
                events[step[1]].set()
            elif step[0] == "wait":
                assert events[step[1]].wait(30), f"job {job} timed out waiting for {step[1]}"
            else:
                ragckpt.commit(url, storage_options=opts, rank_manifests=records)

    try:
        _report(out, (job,), run)
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
        job, outcome, detail = out.get(timeout=90)
        results[job] = (outcome, detail)
    for p in procs:
        p.join(30)
    return results


# -- one process per rank, both jobs released at once -----------------------------------------------------

def _rank_proc(job: str, rank: int, url: str, opts: dict | None, save_id: str | None, world: int, go,
               out: mp.Queue) -> None:
    os.environ["RAGCKPT_JOB_TOKEN"] = f"job-{job}-{url}"
    assert go.wait(60)
    _report(out, (job, rank), lambda: _save(job, url, opts, rank, save_id, world))


def _race_ranks(url: str, opts: dict | None, ids: dict[str, str | None], world: int) -> dict:
    """Every rank of both jobs a process of its own, released together; then each job whose ranks
    all saved commits (what an engine does after counting its ranks' outcomes: a job with a refused
    rank does not). {job: ("ok", None) | ("failed", (type, message))}."""
    go, out = _CTX.Event(), _CTX.Queue()
    procs = [_CTX.Process(target=_rank_proc, args=(j, r, url, opts, ids[j], world, go, out))
             for r in range(world) for j in ("A", "B")]
    for p in procs:
        p.start()
    go.set()
    saved: dict[str, dict] = {"A": {}, "B": {}}
    failed: dict[str, tuple] = {}
    for _ in procs:
        job, rank, outcome, detail = out.get(timeout=90)
        assert outcome != "crashed", detail
        if outcome == "ok":
            saved[job][rank] = detail
        else:
            failed.setdefault(job, detail)
    for p in procs:
        p.join(30)
    results = {j: ("failed", failed[j]) for j in failed}
    for j in saved:
        if j not in failed:
            _report(out, (j,), lambda j=j: ragckpt.commit(url, storage_options=opts, rank_manifests=saved[j]))
            results[j] = out.get(timeout=10)[1:]
    return results


# -- the checks -------------------------------------------------------------------------------------------

def _snapshot(url: str, opts: dict | None) -> dict[str, str]:
    """sha256 of every object of the checkpoint at `url`, by key."""
    store = open_store(url, opts)
    keys = store.list()
    return {k: hashlib.sha256(bytes(raw)).hexdigest() for k, raw in zip(keys, store.read_many(keys), strict=True)}


def _claim_left(url: str, opts: dict | None) -> bool:
    where, key = claim_url(open_store(url, opts)).rsplit("/", 1)
    return open_store(where, opts).exists(key)


def _check_trial(url: str, opts: dict | None, results: dict, world: int = W) -> str:
    """Exactly one job committed; the loser failed with one line naming the directory; the committed
    checkpoint verifies and is all the winner's; the claim is gone. Returns the winner."""
    assert not [r for r in results.values() if r[0] == "crashed"], results
    winners = [j for j, r in results.items() if r[0] == "ok"]
    assert len(winners) == 1, results
    for j, (outcome, detail) in results.items():
        if outcome == "failed":
            kind, msg = detail
            assert "\n" not in msg and url in msg, (j, msg)
            assert kind in ("SaveConflictError", "DestinationExistsError"), (j, kind, msg)
    (winner,) = winners
    ck = ragckpt.open(url, storage_options=opts)
    assert ck.verify().ok
    for name in SHAPES:
        assert_bit_equal(ck.read(name), _state(winner, name))
    want = [_rank_buffers(winner, r, world) for r in range(world)]
    for r in range(world):
        assert_bit_equal(ck.read_local("w", r).reshape(-1), want[r]["float32"])
        assert_bit_equal(ck.extra(r)[0]["rng"], _extra(winner, r)["rng"])
    assert ck.user == {"job": winner}
    assert not _claim_left(url, opts), "the commit left its save claim"
    return winner


def _losers_save_again(url: str, opts: dict | None, loser: str, save_id: str | None, world: int = W) -> None:
    """The losing job's ranks save once more after the commit (from a process of that job, as a rank
    that was late would): every one is refused in one line, and no committed byte changes."""
    before = _snapshot(url, opts)
    out = _CTX.Queue()

    def late() -> None:
        os.environ["RAGCKPT_JOB_TOKEN"] = f"job-{loser}-{url}"
        for r in range(world):
            _report(out, (r,), lambda r=r: _save(loser, url, opts, r, save_id, world))

    p = _CTX.Process(target=late)
    p.start()
    for _ in range(world):
        r, outcome, detail = out.get(timeout=60)
        assert outcome == "failed" and detail[0] == "DestinationExistsError", (r, outcome, detail)
        assert "\n" not in detail[1] and "already committed" in detail[1], detail
    p.join(30)
    assert _snapshot(url, opts) == before
    assert not _claim_left(url, opts), "a late rank left a claim"


ALL = list(range(W))
#: A saves half, B saves everything, then A the other half; both commit
INTERLEAVED = {"A": [("save", ALL[:4]), ("set", "a_half"), ("wait", "b_saved"), ("save", ALL[4:]), ("set", "a_saved"),
                     ("commit",)],
               "B": [("wait", "a_half"), ("save", ALL), ("set", "b_saved"), ("wait", "a_saved"), ("commit",)]}
#: A has saved every rank and commits while B saves; B then finishes and commits
COMMIT_MID_SAVE = {"A": [("save", ALL), ("set", "a_saved"), ("wait", "b_half"), ("commit",), ("set", "a_done")],
                   "B": [("wait", "a_saved"), ("save", ALL[:4]), ("set", "b_half"), ("wait", "a_done"),
                         ("save", ALL[4:]), ("commit",)]}
#: both start at once and run freely
FREE = {"A": [("set", "a_go"), ("wait", "b_go"), ("save", ALL), ("commit",)],
        "B": [("set", "b_go"), ("wait", "a_go"), ("save", ALL), ("commit",)]}

IDS = {"no save_id": {"A": None, "B": None}, "distinct save_ids": {"A": "step5-jobA", "B": "step5-jobB"}}


@pytest.mark.parametrize("ids", list(IDS), ids=list(IDS))
def test_interleaved_saves_have_exactly_one_winner(tmp_path, ids):
    """The issue's case: A saves ranks 0-3, B saves 0-7, A saves 4-7, both commit. Both used to
    overwrite each other's objects and neither could commit; now the directory is A's from its first
    rank on, B's first rank is refused before it writes anything, and A commits."""
    url = str(tmp_path / "ck")
    results = _race(url, None, INTERLEAVED, IDS[ids])
    assert _check_trial(url, None, results) == "A"
    kind, msg = results["B"][1]
    assert kind == "SaveConflictError" and "being saved into by another save" in msg and CLAIM_SUFFIX in msg, msg
    assert "rank 0 of save" in msg, msg
    _losers_save_again(url, None, "B", IDS[ids]["B"])


@pytest.mark.parametrize("ids", list(IDS), ids=list(IDS))
def test_a_save_into_a_directory_another_job_has_saved_is_refused_and_that_job_commits(tmp_path, ids):
    url = str(tmp_path / "ck")
    results = _race(url, None, COMMIT_MID_SAVE, IDS[ids])
    assert _check_trial(url, None, results) == "A"
    assert results["B"][1][0] == "SaveConflictError", results


@pytest.mark.parametrize("ids", list(IDS), ids=list(IDS))
def test_free_running_races_have_exactly_one_winner(tmp_path, ids):
    for trial in range(2):
        url = str(tmp_path / f"ck{trial}")
        _check_trial(url, None, _race(url, None, FREE, IDS[ids]))


@pytest.mark.parametrize("ids", list(IDS), ids=list(IDS))
def test_racing_rank_processes_have_exactly_one_winner(tmp_path, ids):
    """Both jobs' ranks as 8 processes released together, trial after trial: one job's ranks all
    save, the other's are all refused before writing anything, and the winner commits."""
    world = 4
    for trial in range(2):
        url = str(tmp_path / f"ck{trial}")
        winner = _check_trial(url, None, _race_ranks(url, None, IDS[ids], world), world)
        loser = "B" if winner == "A" else "A"
        _losers_save_again(url, None, loser, IDS[ids][loser], world)


@pytest.mark.slow
def test_racing_saves_on_s3(s3):
    opts = s3.storage_options
    url = f"{s3.url}/ck"
    assert _check_trial(url, opts, _race(url, opts, INTERLEAVED, IDS["distinct save_ids"])) == "A"
    url = f"{s3.url}/ranks"
    winner = _check_trial(url, opts, _race_ranks(url, opts, IDS["no save_id"], 2), 2)
    loser = "B" if winner == "A" else "A"
    _losers_save_again(url, opts, loser, None, 2)


def test_a_rank_claiming_just_after_the_commit_released_the_claim_is_refused(tmp_path):
    """The commit deletes its claim after writing COMMITTED; a rank of another save that found no
    marker a moment before then finds no claim either and creates its own. It must check for the
    marker again: it is refused, deletes that claim, and the checkpoint keeps every byte."""
    from ragckpt.checkpoint.writer import _claim

    url = str(tmp_path / "ck")
    records = {r: _save("A", url, None, r, "jobA") for r in range(W)}
    ragckpt.commit(url, rank_manifests=records)
    before = _snapshot(url, None)
    with pytest.raises(ragckpt.DestinationExistsError, match=r"is already committed; save into a new directory$"):
        _claim(open_store(url), "jobB", 3)  # what save_shard does right after its first look for COMMITTED
    assert not _claim_left(url, None) and _snapshot(url, None) == before


def test_a_commit_of_the_losing_save_is_refused(tmp_path):
    """A job that commits anyway (its ranks were refused, or it saved elsewhere) names its save
    and is refused in one line rather than committing the other job's ranks as its own."""
    url = str(tmp_path / "ck")
    for r in range(W):
        _save("A", url, None, r, "step5-jobA")
    with pytest.raises(SaveConflictError, match=r"^cannot commit .* as save 'step5-jobB': rank 0's metadata .* of "
                                                r"save 'step5-jobA'[^\n]*$"):
        ragckpt.commit(url, save_id="step5-jobB")
    ragckpt.commit(url, save_id="step5-jobA")
    assert ragckpt.open(url).verify().ok


def test_a_removed_unfinished_save_frees_the_directory(tmp_path):
    """A save that died half way keeps its claim (nobody can tell it from a slow one); removing the
    remainder with `remove_checkpoint` removes the claim too, and the next save commits."""
    url = str(tmp_path / "ck")
    p = _CTX.Process(target=lambda: [_save("A", url, None, r, "dead") for r in range(3)])  # then it dies
    p.start()
    p.join(60)
    assert p.exitcode == 0
    with pytest.raises(SaveConflictError, match="being saved into by another save 'dead'"):
        _save("B", url, None, 0, "next")
    ragckpt.remove_checkpoint(url)
    assert not os.path.exists(url + CLAIM_SUFFIX)
    for r in range(W):
        _save("B", url, None, r, "next")
    ragckpt.commit(url)
    assert ragckpt.open(url).user == {"job": "B"}


def test_a_new_save_by_the_process_that_claimed_the_directory_takes_it_over(tmp_path):
    """A retry from the same process under another save_id (its earlier attempt failed) gives that
    attempt up: the claim becomes the retry's, and the earlier attempt's commit is refused."""
    url = str(tmp_path / "ck")
    first = {r: _save("A", url, None, r, "attempt-1") for r in range(W)}
    second = {r: _save("B", url, None, r, "attempt-2") for r in range(W)}
    with pytest.raises(SaveConflictError, match="as save 'attempt-1'"):
        ragckpt.commit(url, rank_manifests=first)
    ragckpt.commit(url, rank_manifests=second)
    assert ragckpt.open(url).user == {"job": "B"} and not _claim_left(url, None)


def test_ranks_of_one_job_in_separate_processes_agree_through_the_job_token(tmp_path, monkeypatch):
    """Without save_id, ranks in separate processes share an identity through their job's token
    (here RAGCKPT_JOB_TOKEN; torchrun's run id or MASTER_ADDR:MASTER_PORT in a real job), so one
    job's ranks saved by different processes commit; with no token at all they differ, and the
    second process's first rank is refused instead of mixing its objects in."""
    for k in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "MASTER_ADDR", "RAGCKPT_JOB_TOKEN"):
        monkeypatch.delenv(k, raising=False)
    out = _CTX.Queue()

    def ranks(url: str, job: str, which: list[int]) -> None:
        _report(out, (job,), lambda: [_save(job, url, None, r, None) for r in which])

    for url, token in ((str(tmp_path / "ck"), "job-42"), (str(tmp_path / "ck2"), None)):
        if token:
            monkeypatch.setenv("RAGCKPT_JOB_TOKEN", token)
        else:
            monkeypatch.delenv("RAGCKPT_JOB_TOKEN")
        for job, which in (("A", ALL[:4]), ("B", ALL[4:])):
            p = _CTX.Process(target=ranks, args=(url, job, which))
            p.start()
            p.join(60)
        first, second = out.get(timeout=10), out.get(timeout=10)
        assert first[1] == "ok", first
        if token:
            assert second[1] == "ok", second
            ragckpt.commit(url)
            ck = ragckpt.open(url)
            assert ck.verify().ok
            for r in range(W):  # the two processes are one job's ranks: 0-3 from the first, 4-7 the second
                assert_bit_equal(ck.read_local("w", r).reshape(-1), _rank_buffers("A" if r < 4 else "B", r)["float32"])
            assert ck.user == {"job": "A"}
        else:
            assert second[1] == "failed" and second[2][0] == "SaveConflictError", second
            assert "of save 'auto-" in second[2][1] and "rank 4" in second[2][1], second
            with pytest.raises(ragckpt.FormatError, match="4 of 8 ranks have not finished"):
                ragckpt.commit(url)
    assert save_identity(None).startswith("auto-")

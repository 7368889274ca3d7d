"""`ragfsdp.Checkpointer` across real gloo processes that are SIGKILLed: a resume continues bit for
bit as the uninterrupted run (the same loop, same world size, run straight through in the same
launch), an elastic restart at 3 and 2 ranks (load-time reshard, and after an offline `ragckpt
reshard`) stays within float tolerance of the uninterrupted 4-rank run, a rank killed in the middle
of its background write leaves the previous checkpoint to resume from and the partial one listed as
incomplete, and a save that fails in the store is raised in the loop without losing anything
committed. The jobs are in tests/engine/ckpt_worker.py."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import torch

import ragckpt
from tests.engine import ckpt_worker as w
from tests.helpers import cli_run


def _optimizers() -> list[str]:
    """AdamW and 8-bit Adam where ragfsdp.optim has them; the stateless shard update otherwise."""
    have = [k for k in ("adamw", "adam8bit") if w.optimizer_class(k) is not None]
    return have or ["sgd"]


def _kill(procs: list, which: list[int] | None = None) -> None:
    for i in which if which is not None else range(len(procs)):
        os.kill(procs[i].pid, signal.SIGKILL)
    for i in which if which is not None else range(len(procs)):
        procs[i].join(30)
        assert procs[i].exitcode == -signal.SIGKILL


def _assert_same_params(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for n in a:
        assert torch.equal(a[n], b[n]), n


def test_resume_after_sigkill_of_every_rank_is_bit_identical(tmp_path):
    opts = _optimizers()
    roots = {o: str(tmp_path / f"run-{o}") for o in opts}
    refs = [{"opt": o, "dropout": 0.2, "last": 12} for o in opts]
    firsts = [{"opt": o, "dropout": 0.2, "last": 6, "root": roots[o], "every": 3, "keep_last": 2} for o in opts]
    firsts[-1]["hold"] = True  # the job sits after its last committed save until it is killed
    procs = w.launch(2, tmp_path, refs + firsts, "first")
    w.wait_for(tmp_path, ["held.rank0", "held.rank1"], procs)
    _kill(procs)
    before = w.read_results(tmp_path, "first", 2, procs)  # every phase but the held one's
    for o in opts:
        rows = ragckpt.list_checkpoints(roots[o])
        assert [(ragckpt.step_of(r["url"]), r["committed"]) for r in rows] == [(3, True), (6, True)]
    seconds = [{"opt": o, "dropout": 0.2, "last": 12, "root": roots[o], "every": 3, "keep_last": 2,
                "resume": True} for o in opts]
    procs = w.launch(2, tmp_path, seconds, "second")
    after = w.results(tmp_path, "second", 2, procs)
    assert "resumed step 6 at 2 ranks" in w.log_of(tmp_path, "second")
    n = len(opts)
    for i, o in enumerate(opts):
        ref, second = before[0][i], after[0][i]
        assert second["start"] == 6 and second["resumed_extra"] == {"data_position": 72}, o
        first = before[0][n + i] if i < n - 1 else w.held(tmp_path, 0)
        assert first["losses"] == ref["losses"][:6], o
        assert second["losses"] == ref["losses"][6:], o  # bit for bit, dropout masks included
        for r in range(2):
            _assert_same_params(after[r][i]["params"], before[r][i]["params"])
        assert sorted(ragckpt.step_of(r["url"]) for r in ragckpt.list_checkpoints(roots[o])) == [9, 12]


def _close(a: list[float], b: list[float], tol: float = 1e-4) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= tol * max(1.0, abs(y)) for x, y in zip(a, b, strict=True))


def test_elastic_restart_at_3_and_2_ranks_and_after_an_offline_reshard(tmp_path):
    opt = _optimizers()[0]
    root = str(tmp_path / "run")
    procs = w.launch(4, tmp_path, [{"opt": opt, "last": 12}, {"opt": opt, "last": 6, "root": root, "every": 3}], "w4")
    at4 = w.results(tmp_path, "w4", 4, procs)
    ref, ref_params = at4[0][0]["losses"], at4[0][0]["params"]
    assert at4[0][1]["losses"] == ref[:6]
    resharded = tmp_path / "resharded"
    code, out, err = cli_run("reshard", f"{root}/step-6", str(resharded / "step-6"), "--from", "4", "--to", "2",
                             "--workers", "1", "--no-progress")  # the command, in this process
    assert code == 0, (out, err)
    src = f"{root}/step-6"
    procs = w.launch(3, tmp_path, [{"opt": opt, "last": 12, "root": str(tmp_path / "at3"), "every": 3,
                                    "resume": True, "from_url": src}], "w3")
    at3 = w.results(tmp_path, "w3", 3, procs)
    procs = w.launch(2, tmp_path, [
        {"opt": opt, "last": 12, "root": str(tmp_path / "at2"), "every": 3, "resume": True, "from_url": src},
        {"opt": opt, "last": 12, "root": str(resharded), "every": 3, "resume": True}], "w2")
    at2 = w.results(tmp_path, "w2", 2, procs)
    assert "resumed step 6 from 4 ranks at 3 ranks" in w.log_of(tmp_path, "w3")
    log2 = w.log_of(tmp_path, "w2")
    assert "resumed step 6 from 4 ranks at 2 ranks" in log2 and "resumed step 6 at 2 ranks" in log2
    for name, got in (("3 ranks", at3[0][0]), ("2 ranks", at2[0][0]), ("offline reshard", at2[0][1])):
        assert got["start"] == 6 and got["resumed_extra"] == {"data_position": 72}, name
        assert _close(got["losses"], ref[6:]), (name, got["losses"], ref[6:])
        for n, t in ref_params.items():
            assert torch.allclose(got["params"][n], t, rtol=1e-4, atol=1e-5), (name, n)
    # the restarted jobs save at their own world size
    assert ragckpt.open(str(tmp_path / "at3" / "step-12")).world_size == 3
    assert ragckpt.open(str(resharded / "step-12")).world_size == 2


def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint_and_a_failing_store_loses_nothing(tmp_path):
    opt = _optimizers()[0]
    crash, keep = str(tmp_path / "crash"), str(tmp_path / "keep")
    procs = w.launch(2, tmp_path, [
        {"opt": opt, "dropout": 0.2, "last": 6},
        {"opt": opt, "dropout": 0.2, "last": 6, "root": crash, "every": 3, "block_step": 6, "block_rank": 1,
         "no_params": True}], "c")
    # rank 1's writer thread holds the save of step 6 in flight; rank 0 has written its part
    w.wait_for(tmp_path, ["blocked.rank1", "written.rank0"], procs)
    _kill(procs, [1])
    procs[0].join(60)
    c0 = w.read_results(tmp_path, "c", 1, procs)[0]
    ref = c0[0]
    # the survivor is told in its loop (its writer thread's collective failed), not left believing it saved
    assert [s for s, _ in c0[1]["errors"]] == [6] and "step 6" in c0[1]["errors"][0][1], c0[1]["errors"]
    assert c0[1]["last_committed"].endswith("step-3")
    rows = {ragckpt.step_of(r["url"]): r for r in ragckpt.list_checkpoints(crash)}
    # incomplete: not committed and nothing wrong with what is there (neither damaged nor unreadable)
    assert rows.keys() == {3, 6} and rows[3]["committed"] and not rows[6]["committed"]
    assert not {"damaged", "unreadable"} & rows[6].keys(), rows[6]
    assert ragckpt.open(f"{crash}/step-3").verify().ok
    procs = w.launch(2, tmp_path, [
        {"opt": opt, "dropout": 0.2, "last": 6, "root": crash, "every": 3, "resume": True},
        {"opt": opt, "last": 10, "root": keep, "every": 2, "keep_last": 2, "file_at_step": 6},
        {"opt": opt, "last": 1, "root": keep, "listing_fails_on_rank0": True}], "d")
    d = w.results(tmp_path, "d", 2, procs)
    resumed = d[0][0]
    assert resumed["start"] == 3 and resumed["losses"] == ref["losses"][3:]
    for r in range(2):
        _assert_same_params(d[r][0]["params"], ref["params"])  # the uninterrupted run's (gathered: the same on every rank)
    assert f"skipping {crash}/step-6" in w.log_of(tmp_path, "d")
    assert [(ragckpt.step_of(r["url"]), r["committed"]) for r in ragckpt.list_checkpoints(crash)] == [
        (3, True), (6, True)]  # the re-run of step 6 replaced the partial one
    # the failing store: raised in the loop, at the same step on both ranks, with 2 and 4 still committed
    fails = [d[r][1]["errors"] for r in range(2)]
    assert fails[0] == fails[1] and len(fails[0]) == 1 and "step 6" in fails[0][0][1], fails
    seen_at = fails[0][0][0]
    assert seen_at in (7, 8) and d[0][1]["listings"][seen_at] == [2, 4]
    # raised at step 8's save, that save is not made (the loop was told first); at 7, step 8 saves
    assert w._committed_steps(keep) == ([8, 10] if seen_at == 7 else [4, 10])
    assert ragckpt.open(f"{keep}/step-10").verify().ok and d[0][1]["last_committed"].endswith("step-10")
    assert Path(keep, "step-6").read_text() == "a file where the checkpoint must go"
    # rank 0 alone lists the root for a resume; its failure reaches rank 1 as an error, not a hang
    assert all("injected: listing" in (d[r][2]["resume_error"] or "") for r in range(2)), [d[r][2] for r in range(2)]


def test_sigterm_during_a_background_save_finishes_and_commits_it(tmp_path):
    root = str(tmp_path / "run")
    procs = w.launch(2, tmp_path, [{"opt": _optimizers()[0], "last": 6, "root": root, "every": 3, "gate_step": 6,
                                    "announce_wait": True}], "t")
    w.wait_for(tmp_path, ["gated.rank0", "gated.rank1", "waiting.rank0", "waiting.rank1"], procs)
    for p in procs:
        os.kill(p.pid, signal.SIGTERM)
    # release the writes only once both handlers run: the save must be finished by the handler
    deadline = time.monotonic() + 60
    while not all("SIGTERM: finishing the save of step 6" in w.log_of(tmp_path, "t", r) for r in range(2)):
        assert time.monotonic() < deadline, [w.log_of(tmp_path, "t", r) for r in range(2)]
        time.sleep(0.02)
    (tmp_path / "release").write_text("1")
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [128 + signal.SIGTERM] * 2
    assert [(ragckpt.step_of(r["url"]), r["committed"]) for r in ragckpt.list_checkpoints(root)] == [
        (3, True), (6, True)]
    assert ragckpt.open(f"{root}/step-6").verify().ok

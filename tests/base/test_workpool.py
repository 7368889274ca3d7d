"""StoppablePool: a failed task or an interrupted caller stops the other tasks at their next stop
point, tasks not started never start, and nothing runs once the `with` block is left."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import ragckpt
from ragckpt.checkpoint.reader import Checkpoint
from ragckpt.convert.dcp import export_dcp
from ragckpt.errors import IntegrityError
from ragckpt.workpool import StoppablePool, ahead


def test_a_failing_task_stops_the_others_and_the_caller_sees_that_failure():
    steps: list[tuple[int, int]] = []
    started: list[int] = []

    def task(i: int) -> int:
        started.append(i)
        for step in range(50):
            pool.stop_point()
            if i == 1 and step == 3:
                raise IntegrityError("task 1 found a damaged object")
            steps.append((i, step))
            time.sleep(0.01)
        return i

    with pytest.raises(IntegrityError, match="task 1 found"), StoppablePool(2) as pool:
        list(pool.map(task, range(10)))  # waits on task 0 first: its Stopped must not hide task 1's error
    assert sorted(started) == [0, 1], "queued tasks started after a failure"
    assert len([s for s in steps if s[0] == 0]) < 20, "task 0 ran to its end instead of stopping"


def test_an_interrupted_caller_returns_only_after_the_running_tasks_stopped():
    after: list[int] = []
    left = threading.Event()

    started: list[int] = []

    def task(i: int) -> None:
        started.append(i)
        for _ in range(200):
            time.sleep(0.01)
            if left.is_set():
                after.append(i)  # a task still working after the caller moved on
            pool.stop_point()

    with pytest.raises(KeyboardInterrupt), StoppablePool(2) as pool:
        futs = [pool.submit(task, i) for i in range(6)]
        deadline = time.time() + 5
        while len(started) < 2 and time.time() < deadline:
            time.sleep(0.005)
        raise KeyboardInterrupt
    left.set()
    time.sleep(0.1)
    assert after == []
    assert sorted(started) == [0, 1]  # the queued ones never started
    assert all(f.done() for f in futs)
    assert pool.stopping


def test_results_come_in_order_and_a_clean_exit_waits_for_everything():
    with StoppablePool(3) as pool:
        assert list(pool.map(lambda i: (time.sleep(0.01 * (5 - i)), i)[1], range(5))) == [0, 1, 2, 3, 4]
        fut = pool.submit(lambda: time.sleep(0.1) or "done")
    assert fut.result(timeout=0) == "done"


def test_export_dcp_stops_every_file_when_one_fails(tmp_path, monkeypatch):
    """One file's read fails: the other files stop at their next chunk instead of being written to
    the end (and then deleted), and nothing of the export is left."""
    state = {f"t{i}": torch.randn(64, 256) for i in range(40)}
    src = str(tmp_path / "src")
    ragckpt.write_global(state, src, 2, "row")
    reads: list[str] = []
    real = Checkpoint.read_flat

    def read_flat(self, name, *a, **k):
        if name == "t30":
            raise IntegrityError("object damaged (test)")
        reads.append(name)
        time.sleep(0.02)
        return real(self, name, *a, **k)

    monkeypatch.setattr(Checkpoint, "read_flat", read_flat)
    out = tmp_path / "dcp"
    with pytest.raises(IntegrityError, match="object damaged"):
        export_dcp(src, str(out), workers=2, max_chunk_bytes=64 * 256 * 4)
    # file 0 holds t0..t19, file 1 t20..t39: file 1 fails at its 11th tensor, file 0 stops then
    assert len([n for n in reads if int(n[1:]) < 20]) <= 13, reads
    assert not out.exists() and list(tmp_path.iterdir()) == [tmp_path / "src"]


def test_map_keeps_a_bounded_window_of_tasks_in_flight_and_results_in_order():
    """map submitted every item at once: one future per rank for a million ranks held gigabytes."""
    lock, state = threading.Lock(), {"pending": 0, "most": 0}
    consumed = iter(range(10**9))  # the items are drawn lazily: a list of them would not fit either

    def gen():
        for i in consumed:
            if i == 5000:
                return
            with lock:
                state["pending"] += 1
                state["most"] = max(state["most"], state["pending"])
            yield i

    def task(i: int) -> int:
        return i * i

    with StoppablePool(3) as pool:
        out = []
        for v in pool.map(task, gen()):
            with lock:
                state["pending"] -= 1
            out.append(v)
    assert out == [i * i for i in range(5000)]
    assert state["most"] <= ahead(3) + 1 < 5000, state


def test_map_goes_on_past_one_slow_task_at_the_front():
    """A window of a few tasks per thread left every other thread idle behind one slow first task."""
    done: list[int] = []
    gate = threading.Event()

    def task(i: int) -> int:
        if i == 0:
            gate.wait(30)
        done.append(i)
        return i

    with StoppablePool(4) as pool:
        results = pool.map(task, range(400))
        deadline = time.time() + 20
        while len(done) < 399 and time.time() < deadline:
            time.sleep(0.01)
        finished_behind = len(done)
        gate.set()
        assert list(results) == list(range(400))
    assert finished_behind == 399, finished_behind


def test_map_stopped_early_never_starts_the_rest():
    started: list[int] = []

    def task(i: int) -> int:
        started.append(i)
        return i

    with StoppablePool(2) as pool:
        results = pool.map(task, range(10**6))
        assert next(results) == 0
        results.close()
    assert len(started) <= ahead(2) + 1, len(started)

"""`Checkpointer`: a training loop saves itself every N steps or seconds and comes back after a crash,
at the same or another world size, with two calls (`maybe_save`, `resume`).

Each save is an ordinary committed ragckpt checkpoint `<root>/step-<n>/`, so `ragckpt info`,
`verify`, `reshard` and `export-hf` work on it as on any other. In the background mode the loop waits
only while each rank's buffers are copied into host staging buffers that are reused from save to
save; a writer thread per rank writes them, then the ranks count their successes on a side gloo
group and rank 0 commits, so "latest" can only ever name a checkpoint every rank finished.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch

import ragckpt
from ragfsdp.autockpt import retention, rng
from ragfsdp.autockpt.coordination import Coordinator
from ragfsdp.checkpointing import load_state, state

log = logging.getLogger("ragfsdp.checkpoint")


class CheckpointSaveError(RuntimeError):
    """A checkpoint save failed on some rank (or at its commit); the previous checkpoints are intact."""


@dataclass
class _Save:
    """One save in flight: its step, where it goes, and (once the writer thread is done) how it ended."""

    step: int
    url: str
    future: Any = None  # the rank's save_shard_async future (None for a synchronous save)
    record: dict | None = None  # the rank's record, for a synchronous save
    thread: threading.Thread | None = None
    error: str | None = None
    started: float = field(default_factory=time.monotonic)


class Checkpointer:
    """Saves of a training job under `root_url` (a local path or `s3://...`): every `every_steps`
    steps and/or `every_seconds` seconds, keeping the newest `keep_last` committed ones, in the
    background unless `async_save=False`. Build it on every rank, after the process group; every rank
    must call `maybe_save` at every step (the ranks agree there on whether to save). `seed` reseeds the
    ranks after a restart at another world size, where per-rank RNG states cannot be given back."""

    def __init__(self, root_url: str, *, every_steps: int | None = None, every_seconds: float | None = None,
                 keep_last: int | None = None, async_save: bool = True, storage_options: dict | None = None,
                 seed: int = 0, sigterm_grace_s: float = 120.0) -> None:
        if not isinstance(root_url, str) or not root_url:
            raise ValueError(f"root_url must be a non-empty path or URL, got {root_url!r}")
        for name, value in (("every_steps", every_steps), ("keep_last", keep_last)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        if every_seconds is not None and not every_seconds > 0:
            raise ValueError(f"every_seconds must be positive or None, got {every_seconds!r}")
        self.root_url = root_url.rstrip("/")
        self.every_steps, self.every_seconds, self.keep_last = every_steps, every_seconds, keep_last
        self.async_save, self.storage_options, self.seed = async_save, storage_options, seed
        self.sigterm_grace_s = sigterm_grace_s
        self._coord = Coordinator()
        self.rank, self.world_size = self._coord.rank, self._coord.world_size
        # one identity per job, for every save's save_id: a racing job writing the same step is told apart
        self.job_token = self._coord.broadcast(uuid.uuid4().hex[:16] if self.rank == 0 else None)
        self._staging = ragckpt.StagingBuffers()
        self._pending: _Save | None = None
        self._last_save_time = time.monotonic()
        self.last_committed: str | None = None
        self.resumed_from: str | None = None
        self.resumed_extra: dict = {}
        self._previous_sigterm: Any = None
        if threading.current_thread() is threading.main_thread():
            self._previous_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)

    # -- saving -----------------------------------------------------------------------------------------
    def url_of(self, step: int) -> str:
        return f"{self.root_url}/step-{int(step)}"

    def due(self, step: int) -> bool:
        """Whether `step` is one to save at; the same answer on every rank (time is rank 0's)."""
        by_step = self.every_steps is not None and step % self.every_steps == 0
        if self.every_seconds is None:
            return by_step
        late = time.monotonic() - self._last_save_time >= self.every_seconds
        return bool(self._coord.broadcast(by_step or late))

    def maybe_save(self, step: int, model: torch.nn.Module, optimizer: Any = None, extra: dict | None = None) -> bool:
        """Save after step `step` if it is due; raises here what an earlier background save raised,
        at the first step where every rank's writer thread has ended (the same step on every rank)."""
        self._poll()
        if not self.due(step):
            return False
        self.save(step, model, optimizer, extra)
        return True

    def save(self, step: int, model: torch.nn.Module, optimizer: Any = None, extra: dict | None = None) -> None:
        """Save after step `step` now (every rank calls it). Returns once the buffers are staged
        (background mode) or committed (synchronous mode). An earlier save still in flight is waited
        for first, and its failure raised here (then this step is not saved)."""
        if self._pending is not None:
            if self._pending.thread is not None and self._pending.thread.is_alive():
                log.info("checkpoint: step %d waits for the save of step %d to finish", step, self._pending.step)
            self.wait()
        url = self.url_of(step)
        if not self._clear_leftovers(url):
            return
        st = state(model, optimizer)
        user = {**st["user"], "step": int(step), "extra": dict(extra or {}),
                retention.MARK: {"job": self.job_token, "world_size": self.world_size}}
        kwargs = {"extra": rng.capture(), "user": user, "storage_options": self.storage_options,
                  "save_id": retention.save_id(self.job_token, step)}
        pending = _Save(step=int(step), url=url)
        self._last_save_time = time.monotonic()
        if self.async_save:
            pending.future = ragckpt.save_shard_async(url, st["rank"], st["buffers"], st["layout"],
                                                      staging=self._staging, **kwargs)
            pending.thread = threading.Thread(target=self._finish, args=(pending,), daemon=True,
                                              name=f"ragfsdp-ckpt-step-{step}")
            self._pending = pending
            pending.thread.start()
            return
        try:
            pending.record = ragckpt.save_shard(url, st["rank"], st["buffers"], st["layout"], **kwargs)
        except Exception as e:  # noqa: BLE001 - every rank must reach the count below, failed or not
            pending.error = f"rank {self.rank}: {e}"
        self._pending = pending
        self._finish(pending, writer=False)
        self._raise_finished_failure()

    def _clear_leftovers(self, url: str) -> bool:
        """Rank 0 removes what an earlier, interrupted save of the same step left (a restart from an
        older checkpoint reaches the step again); a committed checkpoint there is kept and this save
        skipped. False when skipped; the same answer on every rank, even when rank 0's look or
        removal fails (the others wait in the broadcast: an exception here would leave them there);
        the save then goes ahead and its own checks decide, on every rank."""
        verdict = None
        if self.rank == 0:
            try:
                verdict = self._leftover_verdict(url)
            except Exception as e:  # noqa: BLE001 - see above
                log.warning("checkpoint: could not clear what an earlier save left at %s: %s", url, e)
        return self._coord.broadcast(verdict) != "committed"

    def _leftover_verdict(self, url: str) -> str | None:
        try:
            ck = ragckpt.open(url, storage_options=self.storage_options)
        except ragckpt.NotCommittedError:
            if retention.is_ours(url, self.storage_options):
                ragckpt.remove_checkpoint(url, storage_options=self.storage_options)
                log.info("checkpoint: removed the unfinished earlier save at %s", url)
                return "cleared"
            return None
        except ragckpt.RagckptError:
            # no root document: a save of ours killed before rank 0 wrote it leaves its claim, which
            # would refuse this save (another save id: a new job token) until removed
            if retention.claimed_by_a_checkpointer(url, self.storage_options):
                ragckpt.remove_checkpoint(url, storage_options=self.storage_options)
                log.info("checkpoint: removed the unfinished earlier save at %s (stopped before its root "
                         "document)", url)
                return "cleared"
            return None  # nothing there (or nothing of ours): the save's own checks decide
        log.warning("checkpoint: %s is committed already; keeping it, not saving step again", ck.url)
        return "committed"

    def _finish(self, pending: _Save, writer: bool = True) -> None:
        """Every rank: wait for this rank's write, count every rank's outcome, rank 0 commits and
        prunes; everyone learns the verdict. Runs in the writer thread in the background mode, where
        an exception would end the thread silently and pass for a success: a collective that fails
        (a peer died mid-save) is this save's failure."""
        try:
            self._count_and_commit(pending, writer)
        except Exception as e:  # noqa: BLE001 - raised in the loop by _raise_finished_failure
            pending.error = f"rank {self.rank}: counting the ranks' outcomes failed: {e}"

    def _count_and_commit(self, pending: _Save, writer: bool) -> None:
        if pending.future is not None:
            try:
                pending.record = pending.future.result()
            except Exception as e:  # noqa: BLE001 - reported to every rank, raised in the loop
                pending.error = f"rank {self.rank}: {e}"
        results = self._coord.gather((pending.error, pending.record if pending.error is None else None),
                                     writer=writer)
        errors = [err for err, _ in results if err is not None]
        verdict: str | None = "; ".join(errors[:3]) if errors else None
        if verdict is None and self.rank == 0:
            verdict = self._commit(pending, [rec for _, rec in results])
        verdict = self._coord.broadcast(verdict, writer=writer)
        pending.error = verdict
        if verdict is None:
            self.last_committed = pending.url
            if self.rank == 0:
                log.info("checkpoint: committed step %d at %s (%.2f s)", pending.step, pending.url,
                         time.monotonic() - pending.started)
                self._prune()

    def _commit(self, pending: _Save, records: list[dict]) -> str | None:
        try:
            ragckpt.commit(pending.url, storage_options=self.storage_options, rank_manifests=records)
        except Exception as e:  # noqa: BLE001 - told to every rank, raised in the loop
            return f"commit: {e}"
        return None

    def _prune(self) -> None:
        """Retention after a commit; a failure to delete an old checkpoint loses nothing and is only logged."""
        try:
            rows = ragckpt.list_checkpoints(self.root_url, storage_options=self.storage_options)
            retention.prune(rows, self.keep_last, self.storage_options)
        except (ragckpt.RagckptError, OSError) as e:
            log.warning("checkpoint: could not remove old checkpoints under %s: %s", self.root_url, e)

    def _poll(self) -> None:
        """While a background save is in flight, ask every rank whether its writer thread ended;
        once all have, its outcome is taken (and a failure raised) on every rank at this same step.
        Judged per rank, a failure would be raised at step n on one rank and n + 1 on another, and
        the next save's collectives would pair up across different steps (a hang). One tiny
        collective per step, only while a save is in flight."""
        p = self._pending
        if p is None or p.thread is None:
            return
        if not self._coord.all_true(not p.thread.is_alive()):
            return
        p.thread.join()
        self._raise_finished_failure()

    def _raise_finished_failure(self) -> None:
        """Raise, in the training loop, the failure of a save whose writer thread has ended."""
        p = self._pending
        if p is None or (p.thread is not None and p.thread.is_alive()):
            return
        self._pending = None
        if p.error is not None:
            raise CheckpointSaveError(f"the checkpoint of step {p.step} at {p.url} failed ({p.error}); earlier "
                                      "checkpoints are intact, fix the storage and resume")

    @property
    def saving(self) -> bool:
        """Whether this rank's background save is still writing (or being counted): for a loop or a
        benchmark that wants to know which steps ran beside a save; deciding anything collective on
        it needs every rank's answer (`maybe_save` takes care of that)."""
        p = self._pending
        return p is not None and p.thread is not None and p.thread.is_alive()

    def wait(self) -> None:
        """Block until the save in flight (if any) has ended; raise its failure."""
        p = self._pending
        if p is not None and p.thread is not None:
            p.thread.join()
        self._raise_finished_failure()

    def close(self, timeout: float | None = None) -> bool:
        """Finish the save in flight, waiting at most `timeout` seconds; True when nothing is left
        running. A save still running after that is abandoned: it stays uncommitted, a resume skips
        it, and a later save of the same step replaces it."""
        p = self._pending
        if p is not None and p.thread is not None:
            p.thread.join(timeout)
            if p.thread.is_alive():
                log.warning("checkpoint: abandoned the save of step %d at %s (still writing after %.0f s); it "
                            "stays uncommitted and resume skips it", p.step, p.url, timeout or 0)
                return False
        if threading.current_thread() is threading.main_thread() and self._previous_sigterm is not None:
            signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._previous_sigterm = None
        return True

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        p = self._pending
        if p is not None and p.thread is not None and p.thread.is_alive():
            log.warning("checkpoint: SIGTERM: finishing the save of step %d (up to %.0f s)", p.step,
                        self.sigterm_grace_s)
        self.close(self.sigterm_grace_s)
        raise SystemExit(128 + signum)

    # -- resuming ---------------------------------------------------------------------------------------
    def resume(self, model: torch.nn.Module, optimizer: Any = None, *, from_url: str | None = None) -> int:
        """Load the newest committed checkpoint under the root (or `from_url`: any ragckpt checkpoint,
        e.g. an `import-hf` of a model) into `model` and `optimizer`, and return its step (0 when
        there is none: start from scratch). Training continues at the step after it."""
        url = from_url or self._latest()
        if url is None:
            return 0
        ck = load_state(model, optimizer, url, storage_options=self.storage_options)
        user = ck.user if isinstance(ck.user, dict) else {}
        step = user.get("step")
        if not isinstance(step, int) or isinstance(step, bool):
            step = ragckpt.step_of(ck.url) or 0
        self._restore_rng(ck, step)
        if ck.world_size != self.world_size:
            msg = f"resumed step {step} from {ck.world_size} ranks at {self.world_size} ranks ({ck.url})"
        else:
            msg = f"resumed step {step} at {self.world_size} ranks ({ck.url})"
        if optimizer is not None and not any(n.startswith("optim.") for n in ck.names()):
            msg += "; the checkpoint holds weights only, the optimizer starts fresh"
        if self.rank == 0:
            log.info("%s", msg)
        self.resumed_from, self.resumed_extra = ck.url, dict(user.get("extra") or {})
        self._last_save_time = time.monotonic()
        return step

    def _latest(self) -> str | None:
        """The newest committed checkpoint under the root, as rank 0 lists it: one listing per job,
        not one per rank (thousands of ranks listing one bucket at once), and one answer, so no two
        ranks can load different steps. Every checkpoint passed over is reported, and the unfinished
        ones older than the chosen one that this checkpointer made are removed. A listing that fails
        on rank 0 is raised on every rank (never a rank left waiting for an answer)."""
        answer: tuple[str, str | None] = ("ok", None)
        failure: Exception | None = None
        if self.rank == 0:
            try:
                answer = ("ok", self._latest_on_rank0())
            except Exception as e:  # noqa: BLE001 - told to every rank below, raised there
                failure, answer = e, ("error", f"{type(e).__name__}: {e}")
        kind, value = self._coord.broadcast(answer)  # also: nobody reads while rank 0 is still removing
        if failure is not None:
            raise failure  # rank 0: the error itself, of its own type
        if kind == "error":
            raise ragckpt.RagckptError(f"listing the checkpoints under {self.root_url} failed on rank 0: {value}")
        return value

    def _latest_on_rank0(self) -> str | None:
        try:
            rows = ragckpt.list_checkpoints(self.root_url, storage_options=self.storage_options)
        except ragckpt.NothingThereError:
            rows = []
        latest = ragckpt.latest_committed(rows)
        for r in rows:
            why = r.get("incomplete") or r.get("damaged") or r.get("unreadable")
            if not why and not r.get("committed"):  # a newer save cut short must be named, not passed over
                why = "not committed: a save that was cut short or is still running"
            if why:
                log.warning("checkpoint: skipping %s (%s)", r["url"], why)
        if latest is None:
            log.info("checkpoint: no committed checkpoint under %s; starting from scratch", self.root_url)
            return None
        _, incomplete = retention.stale(rows, None)
        for u in incomplete:
            if retention.is_ours(u, self.storage_options):
                ragckpt.remove_checkpoint(u, storage_options=self.storage_options)
                log.info("checkpoint: removed the unfinished %s (older than %s)", u, latest["url"])
        return latest["url"]

    def _restore_rng(self, ck: ragckpt.Checkpoint, step: int) -> None:
        if ck.world_size == self.world_size:
            try:
                tensors, _ = ck.extra(self.rank)
            except ragckpt.RagckptError:
                tensors = {}
            if rng.CPU_KEY in tensors:
                rng.restore(tensors)
                return
        rng.reseed(self.seed, step, self.rank)


__all__ = ["CheckpointSaveError", "Checkpointer"]

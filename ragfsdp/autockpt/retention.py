"""Which checkpoints under a checkpointer's root may go, and which must stay.

A checkpoint is only ever deleted when a newer one is committed, and only when this checkpointer
made it (its `step-<n>` name and the mark it leaves in the user metadata): whatever else lives under
the root (a hand-made copy, another tool's output, an imported model) is never touched.
"""

from __future__ import annotations

import logging
import re

import ragckpt

#: the user-metadata key that marks a checkpoint as a checkpointer's own
MARK = "ragfsdp.checkpointer"

log = logging.getLogger("ragfsdp.checkpoint")

_SAVE_ID = re.compile(r"^ragfsdp-[0-9a-f]{16}-step-(\d+)$")


def save_id(job_token: str, step: int) -> str:
    """The save identity of a checkpointer's save of `step`: one per job and step, so a racing job
    writing the same step is told apart, and recognisable as a checkpointer's (`claimed_by_a_checkpointer`)."""
    return f"ragfsdp-{job_token}-step-{int(step)}"


def claimed_by_a_checkpointer(url: str, storage_options: dict | None) -> bool:
    """Whether `url` is held by the claim of a checkpointer's unfinished save of the step it is named
    after. Only a restart of the job that owns the root asks, so the save is an earlier run's, dead."""
    claim = ragckpt.save_claim(url, storage_options=storage_options)
    m = _SAVE_ID.match(str((claim or {}).get("save_id", "")))
    return m is not None and int(m.group(1)) == ragckpt.step_of(url)


def is_ours(url: str, storage_options: dict | None) -> bool:
    """Whether the checkpoint at `url` (committed or not) carries the checkpointer's mark. One that
    cannot be read is not provably ours, so it stays."""
    try:
        ck = ragckpt.open(url, storage_options=storage_options, allow_uncommitted=True)
    except ragckpt.RagckptError:
        return False
    return isinstance(ck.user, dict) and MARK in ck.user


def stale(rows: list[dict], keep_last: int | None) -> tuple[list[str], list[str]]:
    """(committed checkpoints beyond the newest `keep_last`, incomplete ones older than the newest
    committed): candidates only; the caller deletes those that are ours. The newest committed
    checkpoint is never among them."""
    committed = sorted(((ragckpt.step_of(r["url"]), r["url"]) for r in rows if r.get("committed")),
                       key=lambda su: -1 if su[0] is None else su[0], reverse=True)
    committed = [(s, u) for s, u in committed if s is not None]
    if not committed:
        return [], []
    newest = committed[0][0]
    old = [u for _, u in committed[max(1, keep_last):]] if keep_last is not None else []
    incomplete = [r["url"] for r in rows if not r.get("committed") and not {"damaged", "unreadable"} & r.keys()
                  and _older(ragckpt.step_of(r["url"]), newest)]
    return old, incomplete


def _older(step: int | None, than: int) -> bool:
    return step is not None and step < than


def prune(root_rows: list[dict], keep_last: int | None, storage_options: dict | None) -> list[str]:
    """Delete what `stale` names and this checkpointer made; returns the URLs deleted."""
    old, incomplete = stale(root_rows, keep_last)
    gone = []
    for url in old + incomplete:
        if is_ours(url, storage_options):  # a save cut short before its root document stays: not provably ours
            ragckpt.remove_checkpoint(url, storage_options=storage_options)
            gone.append(url)
    for url in gone:
        log.info("checkpoint: removed %s", url)
    return gone

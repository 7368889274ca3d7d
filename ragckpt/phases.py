"""Multi-process jobs (a torchrun reshard, an FSDP2 save) run in phases, each ended by one
collective that gives every process's outcome to all of them. A process that failed still joins
that collective with its error instead of raising alone, so no peer is left waiting in a later
collective for a process that has given up, and every process raises the same one-line error,
naming the lowest failing process and the step it was at."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ragckpt.errors import RagckptError


def one_line(e: BaseException, limit: int = 2000) -> str:
    """An error as one line: ragckpt's messages as they are, anything else with its type."""
    text = " ".join(str(e).split())
    if len(text) > limit:
        text = text[:limit] + "..."
    return text if isinstance(e, RagckptError) else f"{type(e).__name__}: {text}"


class Phase:
    """This process's outcome of one phase: the step it was at, and the error it met if any."""

    def __init__(self) -> None:
        self.step = ""
        self.error: Exception | None = None

    @contextmanager
    def at(self, step: str) -> Iterator[None]:
        """Run the block as `step`; an exception is kept for the phase's collective, not raised."""
        self.step = step
        try:
            yield
        except Exception as e:  # noqa: BLE001 - reported to every process by `exchange`
            self.error = e

    def outcome(self, **extra: object) -> dict:
        if self.error is None:
            return {"ok": True, **extra}
        return {"ok": False, "step": self.step, "error": one_line(self.error), "kind": type(self.error).__name__,
                **extra}


def exchange(dist: Any, mine: Phase, *, group: Any = None, **extra: object) -> tuple[list[dict], list[tuple[int, dict]]]:
    """All-gather every process's outcome of the phase (with `extra` fields): (all outcomes, the
    failed ones as (process, outcome), lowest first). `dist` is `torch.distributed`, passed in so
    that importing this module costs nothing."""
    outcomes: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(outcomes, mine.outcome(**extra), group=group)
    return outcomes, [(r, o) for r, o in enumerate(outcomes) if not o["ok"]]


def failure_message(failed: list[tuple[int, dict]], who: str = "process") -> str:
    """'<who> 3 failed to <step>: <error> (and 2 more <who>(s))' for the lowest failing process."""
    r, o = failed[0]
    more = f" (and {len(failed) - 1} more {who}(s))" if len(failed) > 1 else ""
    return f"{who} {r} failed to {o['step']}: {o['error']}{more}"

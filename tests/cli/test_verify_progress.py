"""The `verify` progress bar: its total is the bytes verify reads (padding included) and it reaches
that total, also when objects are bad."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import ragckpt
from tests.cli_helpers import (
    run,
    save,
)


def test_verify_progress_total_counts_the_bytes_it_reads(tmp_path, monkeypatch):
    import cli.commands.inspect as inspect_cmd
    from cli.common import ProgressBar

    ck = save(str(tmp_path / "ck"), world_size=4, layout="row")  # row shards: edge padding in the chunks
    c = ragckpt.open(ck)
    assert c.verify_bytes() > c.layout.total_bytes()
    seen: dict[str, int] = {"total": -1, "done": 0}

    @contextmanager
    def fake_bar(total, description, enabled=True):
        seen["total"] = total
        yield ProgressBar(type("P", (), {"advance": lambda self, task, n: seen.__setitem__("done", seen["done"] + n)})(),
                          0)

    monkeypatch.setattr(inspect_cmd, "progress_bar", fake_bar)
    rc, out, err = run("verify", ck)
    assert rc == 0, err
    assert seen["total"] == seen["done"] == c.verify_bytes()


def test_verify_progress_reaches_the_total_when_objects_are_bad(tmp_path):
    ck = save(str(tmp_path / "ck"), world_size=4, layout="row")
    chunk = next(p for p in sorted((Path(ck) / "buffers").rglob("c.*")))
    chunk.write_bytes(b"\x00" * 3)  # truncated
    c = ragckpt.open(ck)
    done = []
    rep = c.verify(progress=done.append)
    assert not rep.ok and sum(done) == c.verify_bytes()

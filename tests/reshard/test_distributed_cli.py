"""`ragckpt reshard --distributed` and `python -m cli.distributed` outside a proper torchrun: bad or
missing RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT named in one line, --workers refused, and the
module taking the command's options and printing the command's notes."""

from __future__ import annotations

import pytest

import ragckpt
from tests.cli_helpers import (
    one_line_error,
    save,
    usage_error,
)


@pytest.mark.parametrize("rank, world, needle", [("abc", "2", "RANK is 'abc', not an integer"),
                                                 ("0", "two", "WORLD_SIZE is 'two', not an integer"),
                                                 ("2", "2", "RANK is 2, but WORLD_SIZE is 2"),
                                                 ("0", "0", "WORLD_SIZE is 0")])
def test_bad_torchrun_environment_is_named(tmp_path, monkeypatch, rank, world, needle):
    src = save(str(tmp_path / "src"))
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", world)
    line = one_line_error(["reshard", src, str(tmp_path / "dst"), "--to", "2", "--distributed"], needle)
    assert "is not set" not in line


@pytest.mark.parametrize("addr, port, needle", [(None, "29500", "MASTER_ADDR is not set"),
                                                 ("127.0.0.1", None, "MASTER_PORT is not set"),
                                                 ("127.0.0.1", "x", "MASTER_PORT is 'x', not an integer")])
def test_missing_rendezvous_environment_is_named(tmp_path, monkeypatch, addr, port, needle):
    """RANK and WORLD_SIZE set by hand without torchrun's MASTER_ADDR/PORT: torch raised a bare ValueError."""
    src = save(str(tmp_path / "src"))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    for var, value in (("MASTER_ADDR", addr), ("MASTER_PORT", port)):
        if value is None:
            monkeypatch.delenv(var, raising=False)
        else:
            monkeypatch.setenv(var, value)
    one_line_error(["reshard", src, str(tmp_path / "dst"), "--to", "2", "--distributed"], needle, "torchrun")
    assert not (tmp_path / "dst").exists()


def test_the_torchrun_module_is_the_command(monkeypatch, capsys):
    """`python -m cli.distributed` takes `ragckpt reshard --distributed`'s options: its
    --help has the examples, a usage error is one line (argparse printed a usage block), and a window
    too small for one process does not tell it to use fewer workers it does not have."""
    import cli.distributed as D

    with pytest.raises(SystemExit) as done:
        D.main(["--help"])
    out = capsys.readouterr().out
    assert done.value.code == 0 and "Examples:" in out and "torchrun" in out and "--window" in out, out
    with pytest.raises(SystemExit) as done:
        D.main(["s", "d"])
    err = capsys.readouterr().err
    assert done.value.code == 2 and err.count("\n") == 1 and "Missing option '--to'" in err, err
    from ragckpt.reshard.offline import sizing

    with pytest.raises(ragckpt.errors.LayoutError, match=r"use at least 5 MiB \(--window\)$"):
        sizing(1 << 20, 1, None, 1 << 20)
    with pytest.raises(ragckpt.errors.LayoutError, match=r"\(--window\) or fewer workers \(--workers\)$"):
        sizing(4 << 20, 3, None, 1 << 20)


def test_workers_with_distributed_is_refused_not_ignored(tmp_path):
    src = save(str(tmp_path / "src"))
    msg = usage_error(["reshard", src, str(tmp_path / "dst"), "--to", "2", "--distributed", "--workers", "2"])
    assert "--workers does not apply with --distributed" in msg and "--nproc-per-node" in msg
    assert not (tmp_path / "dst").exists()


def test_the_torchrun_module_prints_the_same_notes_as_the_command(monkeypatch, capsys):
    """`python -m cli.distributed` is documented as equivalent to `ragckpt reshard
    --distributed`: its summary carries the same notes (extras left behind, a leftover set-aside)."""
    import cli.distributed
    import ragckpt.reshard.distributed as D
    from ragckpt.reshard.offline import ReshardStats

    stats = ReshardStats("s", "d", 4, 2, "ragged", "ragged", 3, 10, 10, 10, 1, 1, 1.0, 1e-8, 0, 0, 2, 1, 1, 1,
                         extras_dropped=4, extra={"leftover_set_asides": ["/x/d.replaced-0123456789ab"]})
    monkeypatch.setattr(D, "run", lambda *a, **k: stats)
    with pytest.raises(SystemExit) as done:
        cli.distributed.main(["s", "d", "--to", "2"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.splitlines()[2:] == stats.notes() and len(stats.notes()) == 2
    # the command's own summary: throughput scaled to the job (1e-8 GB/s is 10 B/s), not "0.00 GB/s"
    assert "(0.0 kB/s) with 2 process(es)" in out and "GB/s" not in out, out
    assert "extras (RNG state, ...) of 4 source rank(s) were not carried over" in out
    assert "/x/d.replaced-0123456789ab holds what an earlier --overwrite" in out

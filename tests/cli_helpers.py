"""Helpers for the command-line tests: the `ragckpt` command run in this process with its exit code,
stdout and stderr (`run`), one-line error and usage-error checks, a small checkpoint to run commands
on (`save`), a plain zarr array document, and commands run as a user that file modes apply to
(`as_unprivileged`, `mode`): as root that is `nobody` (setpriv); as anyone else, this process."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import click
import pytest
import torch
from click.testing import CliRunner

import ragckpt
from cli.main import cli
from ragckpt.checkpoint import manifest as mf

ROOT = Path(__file__).resolve().parents[1]
NOBODY = 65534


def run(*args: str) -> tuple[int, str, str]:
    r = CliRunner().invoke(cli, list(args))
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    return r.exit_code, r.stdout, r.stderr


def one_line_error(args: list[str], *needles: str, code: int = 2) -> str:
    rc, out, err = run(*args)
    lines = err.strip().splitlines()
    assert rc == code and len(lines) == 1 and lines[0].startswith("error: "), (rc, out, err)
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def usage_error(args: list[str]) -> str:
    """The message of the click usage error `args` raise (before the command body runs)."""
    with pytest.raises(click.UsageError) as ei:
        cli.main(args, prog_name="ragckpt", standalone_mode=False)
    return ei.value.format_message()


def save(url: str, world_size: int = 2, layout: str = "ragged") -> str:
    ragckpt.write_global({"w": torch.randn(10, 7), "lm_head.weight": torch.randn(3, 4)}, url, world_size, layout)
    return url


def as_unprivileged(*args: str) -> tuple[int, str, str]:
    """Run the CLI as a user that file modes apply to (nobody when we are root)."""
    if os.geteuid() != 0:
        return run(*args)
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: cannot test permission errors")
    p = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", sys.executable,
                        "-m", "cli.main", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
    return p.returncode, p.stdout, p.stderr


@contextmanager
def mode(path: Path, m: int) -> Iterator[None]:
    old = path.stat().st_mode & 0o7777
    path.chmod(m)
    try:
        yield
    finally:
        path.chmod(old)


def assert_one_line(rc: int, err: str, *needles: str) -> str:
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), (rc, err)
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def _plain_array_doc() -> bytes:
    import numpy as np

    return mf.array_doc((3,), np.dtype("float32"), (3,), {})

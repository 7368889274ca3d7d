"""The progress bar: on the terminal's stderr, never in a redirected or piped stdout."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ragckpt

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses a pseudo-terminal")
def test_the_bar_draws_on_the_terminal_stderr_and_stdout_holds_only_the_result(tmp_path):
    """With stderr a TTY and stdout a file, rich drew the bar on stdout (its default console): the
    bar never showed, and the result a script reads started with the bar's empty line."""
    ragckpt.write_global({"w": torch.arange(1 << 16, dtype=torch.float32)}, str(tmp_path / "ck"), 4)
    master, slave = pty.openpty()
    p = subprocess.run([sys.executable, "-m", "cli.main", "verify", str(tmp_path / "ck")], cwd=ROOT,
                       stdout=subprocess.PIPE, stderr=slave, timeout=120)
    os.close(slave)
    seen = b""
    while select.select([master], [], [], 0.5)[0]:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the other end closed
            break
        if not chunk:
            break
        seen += chunk
    os.close(master)
    assert p.returncode == 0, seen
    assert p.stdout.decode().startswith("OK: "), p.stdout  # no empty line, no escape codes
    assert b"\x1b[" in seen, seen  # the bar went to the terminal


def test_human_rate_scales_so_a_small_job_does_not_read_zero():
    from cli.common import human_rate

    assert human_rate(3e9, 2.0) == "1.50 GB/s"
    assert human_rate(4.5e6, 1.0) == "4.50 MB/s"
    assert human_rate(1200, 1.0) == "1.2 kB/s"
    assert human_rate(5, 0.0) == "0.0 kB/s"

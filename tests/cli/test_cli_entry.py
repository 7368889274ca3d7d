"""The `ragckpt` console script itself: plain `ragckpt` shows the overview, and a Ctrl-C while the
commands (and torch) are still importing is one line, not an import traceback."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENTRY = [sys.executable, "-c", "from cli.entry import main; main()"]


def test_plain_ragckpt_prints_the_overview_and_succeeds():
    r = subprocess.run(ENTRY, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("Usage: ragckpt") and "reshard" in r.stdout, r.stderr
    assert r.stderr == ""


#: the entry point with the import of the commands held up for 30 s, so the signal surely lands in it
SLOW_IMPORT = """
import builtins, time
real = builtins.__import__
def slow(name, *args, **kwargs):
    if name == "cli.main":
        time.sleep(30)
    return real(name, *args, **kwargs)
builtins.__import__ = slow
from cli.entry import main
main()
"""


def test_ctrl_c_while_importing_is_one_line():
    p = subprocess.Popen([sys.executable, "-c", SLOW_IMPORT, "info", "/nonexistent"], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(1.0)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130 and err == "error: interrupted\n", err


def test_ctrl_c_while_importing_still_answers_json():
    p = subprocess.Popen([sys.executable, "-c", SLOW_IMPORT, "info", "/nonexistent", "--json"], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(1.0)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130 and err == "error: interrupted\n", err
    assert json.loads(out) == {"error": "interrupted"}, out

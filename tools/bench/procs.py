"""Running a benchmark role in several real rank processes (gloo rendezvous on 127.0.0.1)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(module: str, role: str, world: int, args: list[str]) -> list[dict]:
    """Run `world` processes of `python -m module --role role ARGS`; each prints one JSON line last."""
    port = free_port()
    procs = []
    for r in range(world):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, "-m", module, "--role", role, *args],
                                      cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=1800)
        if p.returncode:
            raise RuntimeError(f"{module} {role} rank failed: {err.strip()[-2000:]}")
        outs.append(json.loads(out.strip().splitlines()[-1]))
    return outs

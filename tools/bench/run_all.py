"""Run every benchmark in tools/bench (each `bench_*.py` exports `main(argv) -> int`).

Usage: python -m tools.bench.run_all [--gib 1.0] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
import time

import tools.bench as pkg

QUICK = {"bench_train": ["--quick"]}  # benchmarks whose full run is too long for `make bench`


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gib", type=float, default=1.0, help="state size for each benchmark")
    ap.add_argument("--only", nargs="*", default=None, help="benchmark module names (e.g. bench_save)")
    args = ap.parse_args(argv)
    names = sorted(m.name for m in pkgutil.iter_modules(pkg.__path__) if m.name.startswith("bench_"))
    if args.only:
        names = [n for n in names if n in args.only]
    failed = []
    for name in names:
        print(f"\n=== {name} ===", flush=True)
        t = time.perf_counter()
        try:
            rc = importlib.import_module(f"tools.bench.{name}").main(["--gib", str(args.gib), *QUICK.get(name, [])])
        except Exception as e:  # one broken benchmark must not hide the others' numbers
            print(f"{name} failed: {type(e).__name__}: {e}", flush=True)
            rc = 1
        print(f"--- {name}: rc={rc} in {time.perf_counter() - t:.1f}s", flush=True)
        if rc:
            failed.append(name)
    if failed:
        print(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Corrupt every file of a checkpoint in turn and check that `verify` names it.

A small committed checkpoint (several dtypes, so several buffers; three ranks, one of which holds
nothing of one buffer; extras on one rank) is built once. Then for every file in it, in a fresh
copy each time: one bit flipped at a seeded random position, the file cut to half its length, or
the file deleted. Each damage must make `ragckpt.open(...)` raise a one-line `RagckptError` naming
the file, or `verify()` report a problem naming it; a verify that says OK, or any other exception,
is a failure.

    python -m tools.fuzz.corrupt_each_file [--kind row|ragged|element] [--seed N] [--json]

exits 1 when any damage went unnoticed. tests/tools/test_corruption_fuzz.py runs it.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

DAMAGES = ("flip", "truncate", "delete")

#: the commit marker's time stamp: informational, read by nothing (the marker's other fields tie it
#: to the checkpoint), so a bit flipped inside it changes nothing a reader or a user relies on
_INFORMATIONAL = {"COMMITTED": re.compile(rb'"committed_at": "([^"]*)"')}


def build(path: str, kind: str = "row") -> None:
    """The checkpoint every damage is applied to: float32, bfloat16, int8, bool and complex64
    tensors at 3 ranks, the bool buffer too short to reach rank 2 (a zero-size shard), extras
    (tensors and string metadata) on rank 1, committed by `save_shard` + `commit` as a job would."""
    import torch

    import ragckpt

    g = torch.Generator().manual_seed(0)
    state = {
        "w": torch.randn(7, 3, generator=g),
        "w.bf16": torch.randn(5, 4, generator=g).to(torch.bfloat16),
        "q": torch.randint(-128, 127, (9,), generator=g, dtype=torch.int8),
        "mask": torch.tensor([True, False]),
        "z": torch.randn(4, generator=g, dtype=torch.complex64),
    }
    with tempfile.TemporaryDirectory() as tmp:
        staged = f"{tmp}/staged"
        layout = ragckpt.write_global(state, staged, 3, kind)
        src = ragckpt.open(staged)
        for r in range(3):
            bufs = {b.name: src.read_rank(b.name, r) for b in layout.buffers}
            extra = {"rng": torch.arange(4, dtype=torch.int64)} if r == 1 else None
            ragckpt.save_shard(path, r, bufs, layout, extra=extra, extra_meta={"step": "7"} if r == 1 else None,
                               user={"step": 7}, save_id="fuzz")
        ragckpt.commit(path)
    if kind == "row" and ragckpt.open(path).layout.rank_sizes("bool")[2] != 0:
        raise AssertionError("the fuzz checkpoint lost its zero-size shard")  # pragma: no cover


def files(root: Path) -> list[str]:
    """Every regular file of the checkpoint at `root`, as keys relative to it."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def _flip_positions(key: str, raw: bytes) -> list[int]:
    """Byte positions of `raw` a flip may hit: all of them, less an informational field's value."""
    skip: set[int] = set()
    pattern = _INFORMATIONAL.get(key)
    m = pattern.search(raw) if pattern else None
    if m:
        skip = set(range(m.start(1), m.end(1)))
    return [i for i in range(len(raw)) if i not in skip]


def corrupt(path: Path, key: str, damage: str, rng: random.Random) -> str:
    """Apply `damage` to file `key` under `path`; returns what was done, in words."""
    f = path / key
    raw = f.read_bytes()
    if damage == "delete":
        f.unlink()
        return "deleted"
    if damage == "truncate":
        f.write_bytes(raw[: len(raw) // 2])
        return f"cut from {len(raw)} to {len(raw) // 2} bytes"
    pos = rng.choice(_flip_positions(key, raw))
    bit = rng.randrange(8)
    f.write_bytes(raw[:pos] + bytes([raw[pos] ^ (1 << bit)]) + raw[pos + 1 :])
    return f"bit {bit} of byte {pos} flipped"


def names(message: str, url: str, key: str) -> bool:
    """Whether `message` names file `key` of the checkpoint at `url`: as a path, or as the key in a
    message about the checkpoint ("URL has a COMMITTED marker but no zarr.json", "checksum mismatch
    in URL/meta/crc/0/c/0 (or in the checksum COMMITTED records for it)"); `zarr.json` is not named
    by `meta/zarr.json`."""
    alone = re.search(rf"(?<![\w/.]){re.escape(key)}(?![\w/])", message)
    return f"{url}/{key}" in message or (url in message and alone is not None)


def judge(url: str, key: str) -> tuple[bool, str]:
    """Open and verify the checkpoint at `url`: whether what it said names `key`, and what it said."""
    import ragckpt
    from ragckpt.errors import RagckptError

    try:
        report = ragckpt.open(url).verify()
    except RagckptError as e:
        msg = str(e)
        return names(msg, url, key) and "\n" not in msg, f"{type(e).__name__}: {msg}"
    except Exception as e:  # noqa: BLE001 - any other exception is what this looks for
        return False, f"raw {type(e).__name__}: {e}"
    if report.ok:
        return False, "verify said OK"
    return any(names(p, url, key) for p in report.problems), "; ".join(report.problems)


@dataclass
class Case:
    key: str
    damage: str
    done: str
    named: bool
    said: str


def run(kind: str = "row", seed: int = 0, workdir: str | None = None,
        on_case: Callable[[Case], None] | None = None) -> list[Case]:
    """Build the checkpoint of `kind`, then damage each of its files in each way in turn."""
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        base = Path(tmp) / "base"
        build(str(base), kind)
        cases = []
        rng = random.Random(seed)
        for key, damage in _plan(base):
            copy = Path(tmp) / "case"
            shutil.copytree(base, copy)
            done = corrupt(copy, key, damage, rng)
            named, said = judge(str(copy), key)
            case = Case(key, damage, done, named, said)
            cases.append(case)
            if on_case:
                on_case(case)
            shutil.rmtree(copy)
        return cases


def _plan(base: Path) -> Iterator[tuple[str, str]]:
    for key in files(base):
        for damage in DAMAGES:
            yield key, damage


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kind", choices=("row", "ragged", "element"), default="row")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="one JSON document of every case")
    args = ap.parse_args(argv)
    cases = run(args.kind, args.seed, on_case=None if args.json else
                lambda c: print(f"{'ok  ' if c.named else 'MISS'} {c.key} {c.damage} ({c.done}): {c.said[:160]}"))
    missed = [c for c in cases if not c.named]
    if args.json:
        print(json.dumps({"kind": args.kind, "seed": args.seed, "cases": [asdict(c) for c in cases]}, indent=1))
    else:
        print(f"{len(cases) - len(missed)} of {len(cases)} damages named")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())

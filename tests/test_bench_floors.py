"""The plain baselines benchmarks print beside ragckpt (tools/bench/floors.py) must move exactly the
bytes they claim to: a floor that read or copied less would flatter every ratio against it."""

from __future__ import annotations

import os

import pytest

from tools.bench.floors import PIECE, direct_copy_tree, read_tree


def _tree(root, sizes: dict[str, int]) -> int:
    for i, (rel, n) in enumerate(sizes.items()):
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom(n) if i % 2 else bytes([i + 1]) * n)
    return sum(sizes.values())


# empty, under a page, not a page multiple, exactly one read piece, a piece and a bit, nested
SIZES = {"empty": 0, "tiny": 5, "odd": 3 * 4096 + 17, "piece": PIECE, "more": PIECE + 4095, "a/b/c.bin": 9000}


def test_direct_copy_tree_copies_every_file_exactly(tmp_path):
    total = _tree(tmp_path / "src", SIZES)
    assert direct_copy_tree(str(tmp_path / "src"), str(tmp_path / "dst"), threads=3) == total
    for rel in SIZES:
        assert (tmp_path / "dst" / rel).read_bytes() == (tmp_path / "src" / rel).read_bytes(), rel


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
def test_read_tree_reads_every_byte_of_every_file(tmp_path, direct):
    total = _tree(tmp_path / "src", SIZES)
    assert read_tree(str(tmp_path / "src"), threads=2, direct=direct) == total
    assert read_tree(str(tmp_path / "src" / "a"), threads=1, direct=direct) == SIZES["a/b/c.bin"]


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


@pytest.mark.parametrize("direct_reads", [False, True], ids=["buffered-reads", "direct-reads"])
def test_direct_copy_tree_copies_every_file_exactly(tmp_path, direct_reads):
    total = _tree(tmp_path / "src", SIZES)
    assert direct_copy_tree(str(tmp_path / "src"), str(tmp_path / "dst"), threads=3, direct_reads=direct_reads) == total
    for rel in SIZES:
        assert (tmp_path / "dst" / rel).read_bytes() == (tmp_path / "src" / rel).read_bytes(), rel


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
def test_read_tree_reads_every_byte_of_every_file(tmp_path, direct):
    total = _tree(tmp_path / "src", SIZES)
    assert read_tree(str(tmp_path / "src"), threads=2, direct=direct) == total
    assert read_tree(str(tmp_path / "src" / "a"), threads=1, direct=direct) == SIZES["a/b/c.bin"]



def test_direct_floors_open_their_sources_with_o_direct(tmp_path, monkeypatch):
    """A floor labelled direct must read direct (where the file system allows it, as /tmp's does
    here), or the bench prints a buffered number under its name."""
    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT on this platform")
    _tree(tmp_path / "src", {"f": PIECE + 4095})
    probe = tmp_path / "probe"
    probe.write_bytes(b"x" * 4096)
    try:
        os.close(os.open(probe, os.O_RDONLY | os.O_DIRECT))
    except OSError:
        pytest.skip("this file system refuses O_DIRECT")
    real, opened = os.open, []

    def spy(path, flags, *a, **k):
        if str(path).startswith(str(tmp_path / "src")):
            opened.append(bool(flags & os.O_DIRECT))
        return real(path, flags, *a, **k)

    monkeypatch.setattr(os, "open", spy)
    read_tree(str(tmp_path / "src"), threads=1, direct=True)
    direct_copy_tree(str(tmp_path / "src"), str(tmp_path / "dst"), threads=1, direct_reads=True)
    read_tree(str(tmp_path / "src"), threads=1)
    direct_copy_tree(str(tmp_path / "src"), str(tmp_path / "dst2"), threads=1)
    assert opened == [True, True, False, False]

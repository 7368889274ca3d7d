"""Fixtures of the command-line tests."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A scratch directory that `nobody` can enter (pytest's tmp_path is private to root)."""
    d = Path(tempfile.mkdtemp(prefix="ragckpt-review-", dir="/tmp"))
    d.chmod(0o755)
    try:
        yield d
    finally:
        for p in [d, *d.rglob("*")]:
            if p.is_dir() and not p.is_symlink():
                p.chmod(0o755)
        shutil.rmtree(d, ignore_errors=True)

"""Evicting a checkpoint's files from the page cache, so a timed load reads from the device the way
a restarted job does (its checkpoint was written by another process, hours or machines ago)."""

from __future__ import annotations

import os


def drop_page_cache(path: str) -> int:
    """posix_fadvise(DONTNEED) `path`, or every file under it (sync first: dirty pages stay cached).
    Returns the number of files. Needs no privileges, unlike /proc/sys/vm/drop_caches."""
    count = 0
    walk = [(os.path.dirname(path), [], [os.path.basename(path)])] if os.path.isfile(path) else os.walk(path)
    for dirpath, _, files in walk:
        for f in files:
            fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            count += 1
    return count


def fsync_tree(path: str) -> None:
    """fsync every file and directory under `path`: the durability a checkpoint writer owes, so
    baselines that do not sync by themselves pay what ragckpt pays."""
    for dirpath, _, files in os.walk(path, topdown=False):
        for name in [*(os.path.join(dirpath, f) for f in files), dirpath]:
            fd = os.open(name, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

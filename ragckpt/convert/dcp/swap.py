"""Putting a finished export-dcp tree in place: an atomic renameat2(RENAME_EXCHANGE) with the
existing directory (two renames where the exchange is unavailable, in-place replacement of the
contents where the directory cannot be renamed, e.g. a mount point), and removal of the
`.tmp-`/`.old-` siblings a killed export left. Kept here rather than in
`ragckpt.storage.destination`, whose --overwrite protocol (set aside with a marker, then discard)
differs in names, steps and guarantees."""

from __future__ import annotations

import ctypes
import errno
import os
import re
import shutil
import uuid

from ragckpt.convert.dcp_format import METADATA_FILE
from ragckpt.errors import (
    DestinationError,
    StorageError,
)
from ragckpt.storage.destination import RENAME_REFUSED
from ragckpt.storage.store import LocalStore, fsync_dir


def _entries(directory: str) -> list[str]:
    """The entries of `directory` that belong to its user: a mount point's `lost+found` is the file
    system's, so a fresh mount point counts as empty."""
    names = os.listdir(directory)
    if os.path.ismount(directory):
        names = [n for n in names if n != "lost+found"]
    return names


def _leftover_pattern(out_dir: str) -> re.Pattern[str]:
    """The sibling names an export into `out_dir` works under: `<name>.tmp-<hex>` while it writes,
    `<name>.old-<hex>` for the tree it replaces."""
    return re.compile(re.escape(os.path.basename(out_dir)) + r"\.(tmp|old)-[0-9a-f]{12}")


def _remove_leftovers(out_dir: str) -> None:
    """Delete the sibling trees a killed earlier export into `out_dir` left (exact names only,
    directories only: nothing a user made)."""
    parent, pattern = os.path.dirname(out_dir), _leftover_pattern(out_dir)
    if not os.path.isdir(parent):  # created later, once the source has been read
        return
    for name in os.listdir(parent):
        path = os.path.join(parent, name)
        if pattern.fullmatch(name) and os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)


try:  # renameat2(2), glibc 2.28+
    _renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
except (OSError, AttributeError):  # pragma: no cover - other C libraries
    _renameat2 = None


def _exchange(a: str, b: str) -> bool:
    """Swap two paths atomically (renameat2 RENAME_EXCHANGE); False where the kernel, the C library
    or the file system cannot."""
    if _renameat2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if _renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), b)


def _swap_in(tmp: str, out_dir: str) -> None:
    """Put the finished tree `tmp` at `out_dir`: a rename when `out_dir` is absent; otherwise the two
    are exchanged atomically and the old tree deleted (where the exchange is not available, the old
    tree is renamed aside and the new one renamed in). Where `out_dir` cannot be renamed (a mount
    point), its contents are replaced in place instead."""
    parent = os.path.dirname(out_dir)
    if not os.path.lexists(out_dir):
        os.rename(tmp, out_dir)
        fsync_dir(parent)
        return
    old = f"{out_dir}.old-{uuid.uuid4().hex[:12]}"
    try:
        if _exchange(tmp, out_dir):
            old = tmp  # `tmp` now holds the old tree: at no moment was there no `out_dir`
        else:
            os.rename(out_dir, old)
    except OSError as e:
        if e.errno in RENAME_REFUSED and os.path.isdir(out_dir) and not os.path.islink(out_dir):
            _replace_contents(tmp, out_dir)
            return
        raise DestinationError(f"cannot replace {out_dir} ({e.strerror}); remove it yourself or choose another "
                               "directory") from None
    if old != tmp:
        try:
            os.rename(tmp, out_dir)
        except OSError as e:
            os.rename(old, out_dir)  # put the old tree back: the export failed, the destination is as it was
            raise DestinationError(f"cannot move the export into {out_dir} ({e.strerror}); it is unchanged") from None
    fsync_dir(parent)
    if os.path.isdir(old) and not os.path.islink(old):
        shutil.rmtree(old)
    else:
        os.remove(old)


def _replace_contents(tmp: str, out_dir: str) -> None:
    """`--overwrite` of a directory that cannot be renamed: delete its entries, the old `.metadata`
    first and durably, then move the new files in (a copy where they cross file systems), each
    fsynced, `.metadata` last. Not atomic: a reader in between, or after a crash, sees no `.metadata`,
    i.e. no checkpoint, never a mix of old and new or an old one with files missing."""
    try:
        LocalStore(out_dir, direct_io=False).delete_all(first=[METADATA_FILE])
        for name in sorted(os.listdir(tmp), key=lambda n: n == METADATA_FILE):
            dst = os.path.join(out_dir, name)
            shutil.move(os.path.join(tmp, name), dst)
            fd = os.open(dst, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(out_dir)
    except StorageError as e:  # the old .metadata could not be deleted
        raise DestinationError(f"cannot replace the contents of {out_dir}: {e}; export again") from None
    except OSError as e:
        raise DestinationError(f"cannot replace the contents of {out_dir}: {e.strerror or e} "
                               f"({e.filename or out_dir}); it is incomplete, export again") from None
    shutil.rmtree(tmp, ignore_errors=True)

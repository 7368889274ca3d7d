"""Where a command may write. A destination is never its own input (an export over its source
checkpoint would delete what it reads), never an empty string (a script's unset variable would
otherwise mean the working directory), and never a directory that holds something else unless the
user asked to replace it."""

from __future__ import annotations

import errno
import glob
import os
import shutil
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from ragckpt.checkpoint import manifest as mf
from ragckpt.errors import (
    AccessDeniedError,
    DestinationError,
    DestinationExistsError,
    RagckptError,
    StorageError,
)
from ragckpt.storage.store import Store, as_url, fsync_dir, local_path, open_store

#: URL schemes that open the same storage as another one (fsspec registers both names)
_SCHEME_ALIASES = {"s3a": "s3", "s3n": "s3", "gs": "gcs", "az": "abfs", "abfss": "abfs"}


def normalize_url(url: str) -> str:
    """A comparable form of a URL, one trailing '/': local paths resolved (symlinks, `..`,
    `file://`); object-store URLs as the store itself parses them, so that every spelling of one
    prefix compares equal (`S3://`, `s3a://`, `s3://bucket//prefix/`)."""
    url = as_url(url)
    path = local_path(url)
    if path is not None:
        return os.path.realpath(path).rstrip("/") + "/"
    scheme, _, rest = url.partition("://")
    scheme = scheme.lower()
    scheme = _SCHEME_ALIASES.get(scheme, scheme)
    if scheme == "s3":  # as S3Store splits it: bucket, then the prefix without its outer slashes
        bucket, _, prefix = rest.strip("/").partition("/")
        rest = bucket + ("/" + prefix.strip("/") if prefix.strip("/") else "")
    return f"{scheme}://{rest.strip('/')}/"


def require_separate(dst: str, sources: Sequence[str] = ()) -> None:
    """Refuse an empty `dst`, and a `dst` that is, contains or lies inside one of `sources`."""
    dst = as_url(dst)
    if not dst or not dst.strip():
        raise DestinationError("the destination is an empty string (an unset variable?); give a path or URL")
    b = normalize_url(dst)
    for src in sources:
        a = normalize_url(src)
        if a.startswith(b) or b.startswith(a):
            raise DestinationError(f"destination {dst} overlaps the source {src}; write into a separate "
                                   "directory or prefix")


def check_checkpoint_destination(store: Store, overwrite: bool) -> None:
    """Make `store` ready for a new checkpoint: absent or empty is fine; a checkpoint or anything else
    there is refused unless `overwrite`, and then its contents are deleted (the directory itself is
    kept, with its owner and mode)."""
    root = getattr(store, "root", None)
    if root is not None and os.path.lexists(root) and not os.path.isdir(root):
        raise DestinationError(f"{store.url} exists and is not a directory; choose another destination")
    committed = store.exists(mf.COMMIT_KEY)
    if committed or store.exists(mf.ROOT_META_KEY):
        if not overwrite:
            what = "a committed" if committed else "an uncommitted"
            raise DestinationExistsError(f"{store.url} already holds {what} checkpoint; choose another "
                                         "destination or pass --overwrite (overwrite=True in Python) to replace it")
    elif store.list(""):
        if not overwrite:
            raise DestinationExistsError(f"{store.url} exists and is not empty; choose an empty destination or "
                                         "pass --overwrite (overwrite=True in Python) to replace its contents")
    else:
        return
    store.delete_all(first=[mf.COMMIT_KEY], last=[mf.ROOT_META_KEY])


# -- replacing a local destination without losing it ---------------------------------------------------

#: errors of a directory rename that mean "not possible here" (a mount point, another file system,
#: no write permission on the parent): callers then replace the contents in place
RENAME_REFUSED = (errno.EBUSY, errno.EXDEV, errno.EPERM, errno.EACCES)
#: what joins a destination's name and an overwrite's tag in the name of its set-aside sibling
ASIDE_INFIX = ".replaced-"


def set_aside(store: Store, tag: str, need_bytes: int = 0) -> str | None:
    """Move what a destination holds out of the way, to the sibling `<dst>.replaced-<tag>`, and
    leave it empty, so that an overwrite which fails half way (a damaged source found only while
    reading it) can put the old contents back. A local directory is renamed (an empty one with the
    same mode and owner takes its place; a symlinked destination has its target set aside); an S3
    prefix is copied server-side and then emptied. None when there is nothing to keep or it cannot
    be done here: another object store, a bucket's root, a directory that cannot be renamed, or a
    file system without `need_bytes` free beside the old contents (the caller then replaces them
    in place, as before)."""
    root = getattr(store, "root", None)
    if root is None:
        return _set_aside_remote(store, tag)
    if not os.path.isdir(root) or not os.listdir(root):
        return None
    root = os.path.realpath(root)
    if need_bytes and shutil.disk_usage(root).free < need_bytes:
        return None
    aside = f"{root}{ASIDE_INFIX}{tag}"
    st = os.stat(root)
    try:
        os.rename(root, aside)
    except FileNotFoundError:  # there a moment ago
        raise DestinationError(_CONCURRENT.format(root=root)) from None
    except OSError as e:
        if e.errno in RENAME_REFUSED:
            return None
        raise
    try:
        os.mkdir(root)
        shutil.copystat(aside, root)
    except (FileExistsError, FileNotFoundError):  # another job re-created it, or moved it away, in between
        raise DestinationError(_CONCURRENT.format(root=root) + f"; its previous contents are in {aside}") from None
    try:
        os.chown(root, st.st_uid, st.st_gid)
    except OSError:  # not ours to give away: the new directory keeps this process's owner
        pass
    fsync_dir(os.path.dirname(root))
    return aside


_CONCURRENT = ("{root} changed while it was being set aside for --overwrite: another job is replacing it at the "
               "same time; let one job finish, then re-run")


def _set_aside_remote(store: Store, tag: str) -> str | None:
    """S3 has no rename: copy every object to the sibling prefix (server-side, the commit marker
    last, so the copy looks committed only when whole), check that all arrived, then empty the
    destination as `--overwrite` always did. None where the copy is refused (no permission to
    write beside DST, say): the caller then replaces DST in place, as before."""
    if not hasattr(store, "copy_in") or not getattr(store, "prefix", ""):
        return None
    sizes = store.list_sizes("")
    if not sizes:
        return None
    aside = store.sibling(ASIDE_INFIX + tag)  # type: ignore[attr-defined]
    try:
        aside.copy_in(store, sizes, last=[mf.COMMIT_KEY])
        got = aside.list_sizes("")
        lost = sorted(k for k, n in sizes.items() if got.get(k) != n)
        if lost:
            raise DestinationError(f"could not set {store.url} aside before overwriting it: the copy of "
                                   f"{store.child(lost[0])} did not arrive whole ({len(lost)} objects); nothing was "
                                   "overwritten, retry the command")
    except AccessDeniedError:
        discard(store, aside.url)
        return None
    except BaseException:
        discard(store, aside.url)
        raise
    try:
        store.delete_all(first=[mf.COMMIT_KEY], last=[mf.ROOT_META_KEY])
    except BaseException as e:  # the copy is whole: undo the partial emptying, or say where the copy is
        attach_note(e, _restore(store, aside.url))
        raise
    return aside.url


def _restore(store: Store, aside: str) -> str:
    """Put what `set_aside` moved to `aside` back (`put_back`); the note that says how it went."""
    if put_back(store, aside):
        return f"{store.url} was left as it was"
    return _kept_in(store, aside)


def _kept_in(store: Store, aside: str) -> str:
    return f"the previous contents of {store.url} are in {aside}"


def attach_note(e: BaseException, note: str) -> None:
    """Say where the old contents of a destination are: in a ragckpt error's own line, else (Ctrl-C,
    SIGTERM, a bug) for the CLI to add to its one line."""
    if isinstance(e, RagckptError) and e.args:
        msg = str(e.args[0]).replace(" — re-run the same command to redo it", "")
        msg = msg.replace("the destination was left uncommitted", note)
        e.args = (msg if note in msg else f"{msg}; {note}", *e.args[1:])
    else:
        e.ragckpt_note = note  # type: ignore[attr-defined]


def _aside_store(store: Store, aside: str) -> Store:
    return store.sibling(aside[len(store.url):])  # type: ignore[attr-defined]


def put_back(store: Store, aside: str) -> bool:
    """Undo `set_aside` after a failed overwrite: the new, partial contents go and the old ones
    return. False when that failed (the old contents are then still at `aside`)."""
    if getattr(store, "root", None) is None:
        try:
            old = _aside_store(store, aside)
            store.delete_all(first=[mf.COMMIT_KEY])
            store.copy_in(old, old.list_sizes(""), last=[mf.COMMIT_KEY])  # type: ignore[attr-defined]
        except RagckptError:
            return False
        discard(store, aside)  # DST is whole again; a copy left behind is reported by the next overwrite
        return True
    root = aside[: aside.rindex(ASIDE_INFIX)]
    try:
        if os.path.lexists(root):
            shutil.rmtree(root)
        os.rename(aside, root)
        fsync_dir(os.path.dirname(root))
    except OSError:
        return False
    return True


def discard(store: Store, aside: str) -> None:
    """The overwrite succeeded: the old contents go (best effort: what stays is reported as a
    leftover by the next overwrite)."""
    if getattr(store, "root", None) is None:
        try:
            _aside_store(store, aside).delete_all(first=[mf.COMMIT_KEY])
        except RagckptError:
            pass
        return
    shutil.rmtree(aside, ignore_errors=True)


def leftover_asides(store: Store) -> list[str]:
    """What overwrites killed outright (SIGKILL, a lost node) left set aside beside `store`. Best
    effort: credentials that may list only DST's own prefix find none."""
    root = getattr(store, "root", None)
    if root is not None:
        return sorted(glob.glob(glob.escape(os.path.realpath(root)) + ASIDE_INFIX + "*"))
    siblings = getattr(store, "siblings", None)
    try:
        return siblings(ASIDE_INFIX) if siblings is not None else []
    except StorageError:
        return []


@contextmanager
def replacing(dst: str, sources: Sequence[str], *, overwrite: bool, storage_options: dict | None, tag: str,
              new_bytes: int) -> Iterator[list[str]]:
    """Around a whole job that writes a checkpoint into `dst`: with `overwrite`, the old contents
    must not be lost to a job that fails half way (a damaged source found only while reading it,
    Ctrl-C, SIGTERM). `dst` is set aside (`set_aside`; a local one needs room for the job's
    `new_bytes` and its metadata beside it) and put back when the job fails, deleted when it
    succeeds. Where it cannot be set aside (an object store other than S3, a bucket's root, a mount
    point, too little free space), a failure says that the old contents are gone (check what can be
    checked of the sources before this). Yields the set-aside siblings that jobs killed outright
    left beside `dst` (for the caller to report). A failure after the job committed keeps the new
    checkpoint."""
    require_separate(dst, sources)
    store = open_store(dst, storage_options)
    leftovers = leftover_asides(store)
    aside = set_aside(store, tag, int(new_bytes * 1.02) + (4 << 20)) if overwrite else None
    emptied = overwrite and aside is None and bool(store.list(""))
    try:
        yield leftovers
    except BaseException as e:
        # after a Ctrl-C or SIGTERM (a kill may follow within seconds) a store that stopped answering
        # must not hold the exit for its retry budget; one that answers quickly restores as usual
        probe = store.hurried() if not isinstance(e, Exception) else store
        try:
            committed = probe.exists(mf.COMMIT_KEY)
        except RagckptError:  # the store itself is failing: say where the old contents are, touch nothing
            if aside is not None:
                attach_note(e, _kept_in(store, aside))
            raise e  # noqa: B904 - the job's own failure, not the check's
        if committed:  # it failed after the commit: the new checkpoint stands
            if aside is not None:
                discard(store, aside)
            raise
        if aside is not None:
            note = _restore(store, aside)
        elif emptied:
            note = f"the previous contents of {store.url} were deleted by --overwrite"
        else:
            raise
        attach_note(e, note)
        raise
    if aside is not None:
        discard(store, aside)

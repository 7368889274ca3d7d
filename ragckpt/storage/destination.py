"""Where a command may write. A destination is never its own input (an export over its source
checkpoint would delete what it reads), never an empty string (a script's unset variable would
otherwise mean the working directory), and never a directory that holds something else unless the
user asked to replace it."""

from __future__ import annotations

import datetime
import errno
import glob
import itertools
import json
import os
import shutil
import signal
import socket
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from ragckpt.errors import (
    AccessDeniedError,
    DestinationError,
    DestinationExistsError,
    RagckptError,
    StorageError,
)
from ragckpt.format.keys import COMMIT_KEY, ROOT_META_KEY
from ragckpt.storage.lock import (
    DestinationBusyError,  # noqa: F401 - raised through here
    is_held,
    lock_holder,
    lock_left,
    writer_lock,
)
from ragckpt.storage.store import LocalStore, Store, as_url, fsync_dir, local_path, open_store

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
    kept, with its owner and mode). Overwrites of `store` killed outright are first finished or
    undone (`recover_locked`), unless this process holds DST's writer lock (its job did that)."""
    root = getattr(store, "root", None)
    if root is not None and os.path.lexists(root) and not os.path.isdir(root):
        raise DestinationError(f"{store.url} exists and is not a directory; choose another destination")
    committed = store.exists(COMMIT_KEY)
    # a copy beside a committed DST changes nothing here (it is the discarded one): look only otherwise
    if not committed and not is_held(store) and leftover_asides(store):
        with writer_lock(store):
            recover_locked(store)
        committed = store.exists(COMMIT_KEY)
    if committed or store.exists(ROOT_META_KEY):
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
    store.delete_all(first=[COMMIT_KEY], last=[ROOT_META_KEY])


# -- replacing a destination without losing it ---------------------------------------------------------

#: errors of a directory rename that mean "not possible here" (a mount point, another file system,
#: no write permission on the parent): callers then replace the contents in place
RENAME_REFUSED = (errno.EBUSY, errno.EXDEV, errno.EPERM, errno.EACCES)
#: what joins a destination's name and an overwrite's tag in the name of its set-aside sibling
ASIDE_INFIX = ".replaced-"
#: the object an overwrite writes into its set-aside copy once the copy is whole: which DST it is
#: the old contents of, and whether the new DST had committed (phase "discard") or not yet
#: ("set-aside"), so that whoever finds the copy after a kill can finish or undo the overwrite
MARKER_KEY = "SET_ASIDE.json"
#: testing knobs: SIGKILL this process at its Nth step of an overwrite (each rename, unlink, copy of
#: a set-aside; see `kill_point`), and append every step's number and name to a file
KILL_ENV = "RAGCKPT_TEST_KILL_AT"
TRACE_ENV = "RAGCKPT_TEST_KILL_TRACE"
_steps = itertools.count(1)


def kill_point(what: str) -> None:
    """One step of an overwrite or of its recovery, where a test may kill this process outright
    (`KILL_ENV`), so that every point a SIGKILL can land on is tried in turn, not by timing."""
    at, trace = os.environ.get(KILL_ENV), os.environ.get(TRACE_ENV)
    if not at and not trace:
        return
    n = next(_steps)
    if trace:
        with open(trace, "a") as f:
            f.write(f"{n} {what}\n")
    if at and n == int(at):
        os.kill(os.getpid(), signal.SIGKILL)


def _write_marker(aside: Store, dst_url: str, phase: str) -> None:
    doc = {"set_aside_of": dst_url, "phase": phase, "pid": os.getpid(), "host": socket.gethostname(),
           "time": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}
    aside.write(MARKER_KEY, [json.dumps(doc).encode()], atomic=True)
    aside.sync()


def read_marker(aside: Store) -> dict | None:
    """The set-aside copy's own description (None: not written yet, or unreadable)."""
    try:
        doc = json.loads(aside.read(MARKER_KEY))
    except (RagckptError, OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def set_aside(store: Store, tag: str, need_bytes: int = 0) -> str | None:
    """Move what a destination holds out of the way, to the sibling `<dst>.replaced-<tag>`, and
    leave it empty, so that an overwrite which fails half way (a damaged source found only while
    reading it) can put the old contents back. A local directory is renamed (an empty one with the
    same mode and owner takes its place; a symlinked destination has its target set aside); an S3
    prefix is copied server-side and then emptied. The copy is marked (`MARKER_KEY`) before DST
    is written to. None when there is nothing to keep or it cannot be done here: another object
    store, a bucket's root, a directory that cannot be renamed, or a file system without
    `need_bytes` free beside the old contents (the caller then replaces them in place, as before)."""
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
    kill_point("set aside: rename DST")
    try:
        os.rename(root, aside)
    except FileNotFoundError:  # there a moment ago
        raise DestinationError(_CONCURRENT.format(root=root)) from None
    except OSError as e:
        if e.errno in RENAME_REFUSED:
            return None
        raise
    kill_point("set aside: make the new DST")
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
    kill_point("set aside: mark the copy")
    _write_marker(LocalStore(aside), store.url, "set-aside")
    return aside


_CONCURRENT = ("{root} changed while it was being set aside for --overwrite: another job is replacing it at the "
               "same time; let one job finish, then re-run")


def _set_aside_remote(store: Store, tag: str) -> str | None:
    """S3 has no rename: copy every object to the sibling prefix (server-side, the commit marker
    last, so the copy looks committed only when whole), check that all arrived, mark the copy, then
    empty the destination as `--overwrite` always did. None where the copy is refused (no
    permission to write beside DST, say): the caller then replaces DST in place, as before."""
    if not hasattr(store, "copy_in") or not getattr(store, "prefix", ""):
        return None
    sizes = store.list_sizes("")
    if not sizes:
        return None
    aside = store.sibling(ASIDE_INFIX + tag)  # type: ignore[attr-defined]
    try:
        kill_point("set aside: copy DST")
        aside.copy_in(store, sizes, last=[COMMIT_KEY])
        got = aside.list_sizes("")
        lost = sorted(k for k, n in sizes.items() if got.get(k) != n)
        if lost:
            raise DestinationError(f"could not set {store.url} aside before overwriting it: the copy of "
                                   f"{store.child(lost[0])} did not arrive whole ({len(lost)} objects); nothing was "
                                   "overwritten, retry the command")
        kill_point("set aside: mark the copy")
        _write_marker(aside, store.url, "set-aside")
    except AccessDeniedError:
        discard(store, aside.url)
        return None
    except BaseException:
        discard(store, aside.url)
        raise
    try:
        kill_point("set aside: empty DST")
        store.delete_all(first=[COMMIT_KEY], last=[ROOT_META_KEY])
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
    return (f"the previous contents of {store.url} are in {aside}; `ragckpt recover {store.url}` moves them back "
            "once nothing else writes there")


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
    if getattr(store, "root", None) is not None:
        return LocalStore(aside)
    return store.sibling(aside[len(store.url):])  # type: ignore[attr-defined]


def _remove_tree(path: str, *, first: Sequence[str] = (), last: Sequence[str] = (), step: str) -> None:
    """Delete a local directory and everything in it: the files named in `first` before any other
    (durably: a commit marker must go before what it covers), those in `last` after all others."""
    if os.path.islink(path) or not os.path.isdir(path):
        if os.path.lexists(path):
            os.unlink(path)
        return
    for name in first:
        if os.path.lexists(os.path.join(path, name)):
            kill_point(step)
            os.unlink(os.path.join(path, name))
            fsync_dir(path)
    keep = {os.path.join(path, n) for n in last}
    for d, dirs, files in os.walk(path, topdown=False):
        for f in files:
            full = os.path.join(d, f)
            if full not in keep:
                kill_point(step)
                os.unlink(full)
        for sub in dirs:
            full = os.path.join(d, sub)
            if os.path.islink(full):
                os.unlink(full)
            else:
                os.rmdir(full)
    for full in keep:
        if os.path.lexists(full):
            kill_point(step)
            os.unlink(full)
    os.rmdir(path)
    fsync_dir(os.path.dirname(path))


def put_back(store: Store, aside: str) -> bool:
    """Undo `set_aside` after a failed overwrite: the new, partial contents go and the old ones
    return. False when that failed (the old contents are then still at `aside`)."""
    try:
        _put_back(store, aside)
    except (RagckptError, OSError):
        return False
    return True


def _put_back(store: Store, aside: str) -> None:
    """`put_back`, raising what went wrong. Every step leaves a state `recover_locked` finishes: DST
    without a commit marker and the marked copy beside it, or DST holding the old contents again."""
    if getattr(store, "root", None) is None:
        old = _aside_store(store, aside)
        kill_point("put back: empty DST")
        store.delete_all(first=[COMMIT_KEY])
        sizes = {k: n for k, n in old.list_sizes("").items() if k != MARKER_KEY}
        kill_point("put back: copy the old contents")
        store.copy_in(old, sizes, last=[COMMIT_KEY])  # type: ignore[attr-defined]
        discard(store, aside)  # DST is whole again
        return
    root = aside[: aside.rindex(ASIDE_INFIX)]
    _remove_tree(root, first=[COMMIT_KEY], step="put back: delete the new DST")
    kill_point("put back: unmark the copy")
    try:
        os.unlink(os.path.join(aside, MARKER_KEY))
    except FileNotFoundError:
        pass
    kill_point("put back: rename the copy to DST")
    os.rename(aside, root)
    fsync_dir(os.path.dirname(root))


def discard(store: Store, aside: str) -> None:
    """The overwrite succeeded: the old contents go. The copy is first marked as being discarded,
    then its commit marker goes, its `MARKER_KEY` last, so a kill half way leaves a remainder
    that says what it is. Best effort: what stays is finished by the next run into DST."""
    try:
        _discard(store, aside)
    except (RagckptError, OSError):
        pass


def _discard(store: Store, aside: str) -> None:
    old = _aside_store(store, aside)
    local = getattr(store, "root", None) is not None
    if local and not os.path.isdir(aside):
        return
    if old.list(""):
        kill_point("discard: mark the copy")
        try:
            _write_marker(old, store.url, "discard")
        except RagckptError:  # may not write there (an aborted copy's, say): deleting it is what counts
            pass
    if local:
        _remove_tree(aside, first=[COMMIT_KEY], last=[MARKER_KEY], step="discard: delete the copy")
        return
    kill_point("discard: delete the copy")
    old.delete_all(first=[COMMIT_KEY], last=[MARKER_KEY])


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


# -- finishing or undoing an interrupted overwrite ---------------------------------------------------------

def decide(store: Store, aside: str) -> tuple[str, str]:
    """What the set-aside copy `aside` of `store` is, for an overwrite no longer running: ("restore",
    why) when the new DST never committed, so the copy is the checkpoint DST must hold again;
    ("delete", why) when the new DST committed (the copy was being discarded) or the copy never
    got whole (DST was still as it was). Kill by kill point:

    * local: the rename is atomic, so the copy is always whole until it is discarded, which marks
      it "discard" first; DST committed means the overwrite's own commit (the writer lock kept
      every other job out, and every job finishes these copies before it writes);
    * S3: the copy is marked only once whole and before DST is emptied, so an unmarked copy beside
      a DST that is not committed either is a copy cut short of a DST that was not committed to
      begin with; an unmarked but committed one beside an uncommitted DST is an older
      ragckpt's whole copy (its marker did not exist yet)."""
    old = _aside_store(store, aside)
    marker = read_marker(old)
    dst = store.url
    if marker is not None and marker.get("phase") == "discard":
        return "delete", f"an overwrite of {dst} had committed the new checkpoint and was deleting this old copy"
    if not [k for k in old.list("") if k != MARKER_KEY]:
        return "delete", "an empty remainder of a set-aside copy"
    if store.exists(COMMIT_KEY):
        return "delete", (f"the old contents of {dst}, set aside by an overwrite that committed the new checkpoint "
                          "there before it was interrupted")
    local = getattr(store, "root", None) is not None
    if marker is None and not local and not old.exists(COMMIT_KEY):
        return "delete", (f"an unfinished copy of {dst}, whose overwrite was interrupted while setting it aside; "
                          f"{dst} itself was not touched")
    return "restore", (f"the old contents of {dst}, set aside by an overwrite that was interrupted before it "
                       "committed the new checkpoint")


def recover(dst: str, storage_options: dict | None = None) -> list[dict]:
    """Finish or undo every overwrite of `dst` that was killed outright (`recover_locked`), under
    DST's writer lock: DestinationBusyError while another job writes there (its set-aside copy
    is its own; with no copy beside DST there is nothing to wait for). One dict per set-aside copy found: `set_aside` (its URL), `action` ("restored",
    "deleted" or "kept") and `reason`."""
    store = open_store(dst, storage_options)
    if not leftover_asides(store) and not lock_left(store):  # nothing to finish, no killed job's lock to clear
        return []
    with writer_lock(store):
        return recover_locked(store)


def recover_locked(store: Store) -> list[dict]:
    """`recover` for a caller already holding DST's writer lock (every job that writes into DST
    calls it before looking at DST). Two copies that would both go back are kept, both of them,
    since nothing says which is newer."""
    plans = [(a, *decide(store, a)) for a in leftover_asides(store)]
    several = sum(action == "restore" for _, action, _ in plans) > 1
    out = []
    for aside, action, why in plans:
        if action == "restore" and several:
            out.append({"set_aside": aside, "action": "kept", "reason": (
                f"{why}; more than one such copy is beside {store.url} and ragckpt cannot tell which to move back: "
                f"rename the one to keep to {store.url} yourself (`ragckpt ls -l` shows when each was created), "
                "or to another name to keep both")})
            continue
        try:
            if action == "restore":
                _put_back(store, aside)
            else:
                _discard(store, aside)
        except (RagckptError, OSError) as e:
            raise DestinationError(f"could not {'move ' + aside + ' back to' if action == 'restore' else 'delete'} "
                                   f"{store.url if action == 'restore' else aside} ({why}): {one_line(e)}; nothing "
                                   f"was lost: re-run `ragckpt recover {store.url}`") from None
        out.append({"set_aside": aside, "action": "restored" if action == "restore" else "deleted", "reason": why})
    return out


def describe_set_aside(url: str, storage_options: dict | None = None) -> str | None:
    """For a listing: what the set-aside copy at `url` is and what `ragckpt recover` does with it;
    None for a URL that is no set-aside copy."""
    name = url.rstrip("/")
    if ASIDE_INFIX not in name.rsplit("/", 1)[-1]:
        return None
    dst = name[: name.rindex(ASIDE_INFIX)]
    try:
        store = open_store(dst, storage_options)
        who = lock_holder(store)
        if who is not None:
            return f"set aside by a running --overwrite of {dst} ({who}); it is that job's"
        action, why = decide(store, _aside_url(store, name))
    except (RagckptError, OSError) as e:
        return f"set aside by an --overwrite of {dst}; it could not be judged ({one_line(e)})"
    does = "moves it back" if action == "restore" else "deletes it"
    return f"set aside by an interrupted --overwrite: {why}; `ragckpt recover {dst}` {does}"


def annotate_set_asides(rows: list[dict], storage_options: dict | None = None) -> list[dict]:
    """Listing rows (`url`, ...) with `set_aside` added where a row is an overwrite's set-aside copy
    (`describe_set_aside`) or the destination of one: what it is and that `ragckpt recover DST`
    finishes the overwrite, so that a listing never leaves a user to move copies by hand."""
    urls = {r["url"].rstrip("/") for r in rows}
    out = []
    for r in rows:
        url = r["url"].rstrip("/")
        note = describe_set_aside(url, storage_options)
        here = local_path(url)  # a local copy reduced to its marker lists as no checkpoint of its own
        if note is None and (any(u.startswith(url + ASIDE_INFIX) for u in urls)
                             or (here is not None and leftover_asides(LocalStore(here)))):
            note = f"an --overwrite of it left a set-aside copy beside it; `ragckpt recover {url}` says what it was"
        out.append({**r, "set_aside": note} if note else r)
    return out


def _aside_url(store: Store, name: str) -> str:
    root = getattr(store, "root", None)
    if root is not None:
        return os.path.realpath(root) + name[name.rindex(ASIDE_INFIX):]
    return store.url + name[name.rindex(ASIDE_INFIX):]


def one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


@contextmanager
def replacing(dst: str, sources: Sequence[str], *, overwrite: bool, storage_options: dict | None, tag: str,
              new_bytes: int) -> Iterator[list[str]]:
    """Around a whole job that writes a checkpoint into `dst`. It holds DST's writer lock (a second
    job started into DST meanwhile stops with DestinationBusyError) and first finishes or undoes
    what overwrites killed outright left (`recover_locked`). With `overwrite`, the old contents
    must not be lost to a job that fails half way (a damaged source found only while reading it,
    Ctrl-C, SIGTERM). `dst` is set aside (`set_aside`; a local one needs room for the job's
    `new_bytes` and its metadata beside it) and put back when the job fails, deleted when it
    succeeds. Where it cannot be set aside (an object store other than S3, a bucket's root, a mount
    point, too little free space), a failure says that the old contents are gone (check what can be
    checked of the sources before this). Yields the set-aside siblings that could not be recovered
    (for the caller to report). A failure after the job committed keeps the new checkpoint."""
    require_separate(dst, sources)
    store = open_store(dst, storage_options)
    with writer_lock(store):
        leftovers = [r["set_aside"] for r in recover_locked(store) if r["action"] == "kept"]
        aside = set_aside(store, tag, int(new_bytes * 1.02) + (4 << 20)) if overwrite else None
        emptied = overwrite and aside is None and bool(store.list(""))
        kill_point("job: write the new DST")
        try:
            yield leftovers
        except BaseException as e:
            # after a Ctrl-C or SIGTERM (a kill may follow within seconds) a store that stopped answering
            # must not hold the exit for its retry budget; one that answers quickly restores as usual
            probe = store.hurried() if not isinstance(e, Exception) else store
            try:
                committed = probe.exists(COMMIT_KEY)
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
        kill_point("job: committed")
        if aside is not None:
            discard(store, aside)

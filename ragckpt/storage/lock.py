"""One writer per destination. Two jobs started into one DST at once (two identical reshards, a
retry launched while the first still runs) must not both take DST for their own: the second one
would read the first's live output as the remainder of a killed run and delete it under it.

A job therefore holds DST's writer lock from its first look at DST to its commit, and the lock
must tell a live writer from a dead one without anyone's help:

* local files: `flock(2)` on the sibling file `DST.ragckpt-lock`. The kernel drops the lock when
  its holder dies (SIGKILL, OOM), so a killed job's lock file is simply taken over. The file says
  who holds it (pid, host, boot id, start time, command) for the refusal's message; the holder
  unlinks it before letting go, and a taker checks that the file it locked is still the one at
  that name (else it locked an unlinked file and tries again). Where the parent directory takes no
  new file, the DST directory itself is locked (it then cannot be renamed either, so an overwrite
  replaces it in place and the lock stays on it).
* S3: a lease object `DST.ragckpt-lock/lease.json` created with a conditional PUT (exactly one
  creator wins), naming the holder and an expiry that a heartbeat thread pushes forward every
  third of `LEASE_TTL_S`. A lease past its expiry is a dead job's and is taken over (deleted, then
  created again conditionally). Credentials that may not write beside DST get no lock.
* other fsspec stores: none (their creates are not known to be atomic).

Within one process the lock is re-entrant: a job's own later checks of DST find it held by
themselves."""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from ragckpt.errors import (
    AccessDeniedError,
    BadObjectError,
    DestinationError,
    DestinationExistsError,
    StorageError,
)
from ragckpt.storage.store import LocalStore, Store

#: what joins a destination's name and the lock's suffix
LOCK_SUFFIX = ".ragckpt-lock"
LEASE_KEY = "lease.json"
#: seconds an S3 lease lasts without a heartbeat (a killed job's DST is free again after this)
LEASE_TTL_S = float(os.environ.get("RAGCKPT_LEASE_TTL_S", "60") or 60)

_held: dict[str, int] = {}
_held_lock = threading.Lock()


class DestinationBusyError(DestinationError):
    """Another live job holds the destination's writer lock."""


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _start_ticks(pid: int) -> str:
    """When process `pid` started (clock ticks since boot; "" where unknown): with the boot id,
    what tells the process from a later one that got the same pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def holder_gone(doc: dict) -> bool:
    """The lock's holder is known to be dead: it ran on this machine since its last boot, and no
    process with its pid and start time is left. False wherever that cannot be told (another
    machine: there only the lease's expiry says it)."""
    boot = _boot_id()
    if not boot or doc.get("boot_id") != boot or doc.get("host") != socket.gethostname() or not doc.get("pid_start"):
        return False
    return _start_ticks(int(doc.get("pid", 0))) != doc["pid_start"]


def holder_doc(**more: object) -> bytes:
    """Who this process is, for another job's refusal to name."""
    doc = {"pid": os.getpid(), "pid_start": _start_ticks(os.getpid()), "host": socket.gethostname(), "boot_id": _boot_id(),
           "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
           "command": " ".join(os.path.basename(a) if i == 0 else a for i, a in enumerate(sys.argv))[:300], **more}
    return json.dumps(doc).encode()


def _busy(url: str, raw: bytes | None) -> DestinationBusyError:
    return DestinationBusyError(f"another job is writing {url} ({_who(raw)}); wait for it to finish, or choose "
                                "another destination")


def is_held(store: Store) -> bool:
    """Whether this process holds `store`'s writer lock."""
    with _held_lock:
        return _held.get(_key(store), 0) > 0


def _key(store: Store) -> str:
    root = getattr(store, "root", None)
    return os.path.realpath(root) if root is not None else store.url.rstrip("/")


@contextmanager
def writer_lock(store: Store) -> Iterator[None]:
    """Hold `store`'s writer lock for the body; DestinationBusyError when another live job holds it."""
    key = _key(store)
    with _held_lock:
        depth = _held.get(key, 0)
        _held[key] = depth + 1
    try:
        if depth:
            yield
            return
        if getattr(store, "root", None) is not None:
            cm = _local_lock(store)
        elif hasattr(store, "sibling") and getattr(store, "prefix", ""):
            cm = _s3_lease(store)
        else:
            cm = _no_lock()
        with cm:
            yield
    finally:
        with _held_lock:
            _held[key] -= 1
            if not _held[key]:
                del _held[key]


@contextmanager
def _no_lock() -> Iterator[None]:
    yield


@contextmanager
def _local_lock(store: Store) -> Iterator[None]:
    root = os.path.realpath(store.root)  # type: ignore[attr-defined]
    path = root + LOCK_SUFFIX
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except FileNotFoundError:  # DST's parent does not exist yet: the job would create it anyway
            os.makedirs(os.path.dirname(path), exist_ok=True)
            continue
        except OSError as e:
            if e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS) or not os.path.isdir(root):
                raise
            with _dir_lock(root, store.url):
                yield
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                raw = _holder_of(fd)
            finally:
                os.close(fd)
            raise _busy(store.url, raw) from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # the holder unlinked it just before letting go: lock the new one
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, holder_doc(), 0)
        yield
    finally:
        try:
            os.unlink(path)  # while still holding it: a taker that locked this file sees it gone
        except OSError:
            pass
        os.close(fd)


def _holder_of(fd: int) -> bytes:
    """The holder document of a lock file another job holds. It writes it just after its flock, so
    a job refused in between finds the file empty: wait a moment for it rather than name nobody."""
    raw = os.pread(fd, 4096, 0)
    for _ in range(20):
        if raw.strip():
            break
        time.sleep(0.025)
        raw = os.pread(fd, 4096, 0)
    return raw


@contextmanager
def _dir_lock(root: str, url: str) -> Iterator[None]:
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise _busy(url, None) from None
        yield
    finally:
        os.close(fd)


class _Lease:
    """An S3 lease object: created conditionally, refreshed by a heartbeat, deleted at the end."""

    def __init__(self, store: Store):
        self.url = store.url
        self.at = store.sibling(LOCK_SUFFIX)  # type: ignore[attr-defined]
        self.owner = uuid.uuid4().hex
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        #: when (monotonic) this job last wrote its lease: until half a TTL later nobody can have
        #: taken it over (a taker waits for the expiry, a whole TTL after that write)
        self.written = float("-inf")

    def doc(self) -> bytes:
        return holder_doc(owner=self.owner, expires=time.time() + LEASE_TTL_S)

    def acquire(self) -> bool:
        """True once held; False where the credentials may not write beside DST."""
        for _ in range(3):
            try:
                now = time.monotonic()
                self.at.write(LEASE_KEY, [self.doc()], create_only=True)
                self.written = now
                break
            except AccessDeniedError:
                return False
            except DestinationExistsError:
                try:
                    raw = self.at.read(LEASE_KEY)
                except StorageError:
                    continue  # deleted in between: try to create it again
                if _live(raw):
                    raise _busy(self.url, raw) from None
                self.at.delete(LEASE_KEY)  # a dead job's: take it over
        else:
            raise _busy(self.url, None)
        self.thread = threading.Thread(target=self.beat, name="ragckpt-lease", daemon=True)
        self.thread.start()
        return True

    def mine(self) -> bool:
        try:
            return json.loads(self.at.read(LEASE_KEY)).get("owner") == self.owner
        except (StorageError, ValueError, AttributeError):
            return False

    def beat(self) -> None:
        while not self.stop.wait(LEASE_TTL_S / 3):
            try:
                if not self.mine():
                    return  # taken over (this job stalled past its expiry): never write over the new holder
                if self.stop.is_set():
                    return  # released meanwhile: a write now would create the lease again
                now = time.monotonic()
                self.at.write(LEASE_KEY, [self.doc()])
                self.written = now
            except StorageError:
                pass  # the next beat tries again; the lease lasts a whole TTL

    def release(self) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join(5)
        # one quick attempt per request: after a Ctrl-C or SIGTERM a kill may follow within seconds,
        # and a lease left behind only keeps DST busy until it expires
        self.at = self.at.hurried()
        try:
            # reading the lease back to see it is still ours is skipped while it cannot have been taken
            # over: against a store that stopped answering, that GET waited out the client's read
            # timeout (30 s), past the grace a kill follows a SIGTERM within
            if time.monotonic() - self.written < LEASE_TTL_S / 2 or self.mine():
                self.at.delete(LEASE_KEY)
        except StorageError:
            pass


@contextmanager
def _s3_lease(store: Store) -> Iterator[None]:
    lease = _Lease(store)
    held = lease.acquire()
    try:
        yield
    finally:
        if held:
            lease.release()


def lock_left(store: Store) -> bool:
    """Whether `store` has a lock file or lease at all (a killed job's, or a live one's)."""
    root = getattr(store, "root", None)
    if root is not None:
        return os.path.lexists(os.path.realpath(root) + LOCK_SUFFIX)
    if hasattr(store, "sibling") and getattr(store, "prefix", ""):
        try:
            return store.sibling(LOCK_SUFFIX).exists(LEASE_KEY)  # type: ignore[attr-defined]
        except StorageError:
            return False
    return False


def lock_holder(store: Store) -> str | None:
    """Who holds `store`'s writer lock right now ("pid 123 on host-a, since ..."), or None when
    nobody does (or this process does): lets a listing tell a running overwrite from a killed one
    without taking the lock."""
    if is_held(store):
        return None
    root = getattr(store, "root", None)
    if root is not None:
        try:
            fd = os.open(os.path.realpath(root) + LOCK_SUFFIX, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return _who(os.pread(fd, 4096, 0))
            return None
        finally:
            os.close(fd)
    if hasattr(store, "sibling") and getattr(store, "prefix", ""):
        try:
            raw = store.sibling(LOCK_SUFFIX).read(LEASE_KEY)  # type: ignore[attr-defined]
        except StorageError:
            return None
        return _who(raw) if _live(raw) else None
    return None


def _live(raw: bytes) -> bool:
    """Whether the lease `raw` may still be its holder's: not expired, and its holder not known dead."""
    try:
        doc = json.loads(raw)
        return float(doc["expires"]) > time.time() and not holder_gone(doc)
    except (ValueError, KeyError, TypeError, AttributeError):
        return False  # torn or foreign: nobody can be refreshing it


def _who(raw: bytes | None) -> str:
    try:
        doc = json.loads(raw or b"{}")
        return f"pid {doc['pid']} on {doc['host']}, since {doc['started']}"
    except (ValueError, KeyError, TypeError):
        return "a job that has not said who it is yet"


# -- the save claim --------------------------------------------------------------------------------------
# `save_shard` ranks of one save write objects with the same names as another save's ranks would
# (`buffers/<b>/c.<r>.<j>`, `ranks/<r>.json`): two jobs saving into one directory at once overwrote
# each other's objects, and usually neither could commit. So the first rank of any save to reach a
# destination claims it for its save, create-if-absent, and ranks of any other save refuse before
# writing a byte: exactly one save writes there, and its commit is the only one that can succeed.
# The claim sits beside the destination (like the writer lock) rather than in it, so that every
# object inside keeps exactly one writer; the commit deletes it after writing COMMITTED.

#: what joins a destination's name and its save claim's suffix
CLAIM_SUFFIX = ".ragckpt-save"
CLAIM_KEY = "claim.json"


def _claim_place(store: Store) -> tuple[Store, str] | None:
    """The store and key of `store`'s save claim: `DST.ragckpt-save` beside a local directory, the
    object `DST.ragckpt-save/claim.json` beside an S3 prefix; None where there is no atomic
    create-if-absent or no place beside (a bucket's root, other fsspec stores)."""
    root = getattr(store, "root", None)
    if root is not None:
        parent, name = os.path.split(os.path.realpath(root))
        if not name:
            return None  # the file system's root has no place beside it
        return LocalStore(parent, direct_io=False), name + CLAIM_SUFFIX
    if hasattr(store, "sibling") and getattr(store, "prefix", "") and getattr(store, "atomic_create", True):
        return store.sibling(CLAIM_SUFFIX), CLAIM_KEY  # type: ignore[attr-defined]
    return None


def claim_url(store: Store) -> str | None:
    """Where `store`'s save claim is (or would be), for messages; None where there is none."""
    place = _claim_place(store)
    return None if place is None else place[0].child(place[1])


def read_claim(store: Store) -> dict | None:
    """The save claim of `store`, None when there is none. A claim that is not a JSON object (it
    cannot be torn: it is created whole) is returned as `{}`: it names no save, so it is nobody's."""
    place = _claim_place(store)
    if place is None:
        return None
    at, key = place
    for attempt in range(3):
        try:
            raw = at.read(key)
            break
        except BadObjectError:
            if not at.exists(key):
                return None
            if attempt == 2:
                raise
            # created by another rank between the two requests: read it now
    try:
        doc = json.loads(raw)
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}


def claim_for_save(store: Store, save_id: str) -> dict | None:
    """Claim `store` for save `save_id` unless another save has: returns None when this save holds
    the claim (just created, or created by another rank of it) or the store has no claims, else the
    other save's claim document. Reading first spares the PUT for every rank but the first."""
    place = _claim_place(store)
    if place is None:
        return None
    at, key = place
    for _ in range(3):
        doc = read_claim(store)
        if doc is not None:
            if doc.get("save_id") == save_id:
                return None
            if not _claimed_here(doc):
                return doc
            # this very process claimed it for an earlier save: starting another save into the same
            # directory, it has given that one up (a retry after a failed attempt). Ranks of that
            # save in other processes, if any, are refused from then on, and its commit too. Replaced
            # whole, never deleted first: no other save may find the directory unclaimed meanwhile
            at.write(key, [holder_doc(save_id=save_id)], atomic=True)
            at.sync()
            return None
        try:
            at.write(key, [holder_doc(save_id=save_id)], create_only=True)
            at.sync()  # DST's parents may be created here, and a save makes the directories it creates durable
            return None
        except DestinationExistsError:
            continue  # another rank got there first: read whose it is
        except AccessDeniedError:
            return None  # credentials that may not write beside DST: no claim, as no lock
        except StorageError as e:
            if isinstance(e.__cause__, PermissionError | FileNotFoundError):
                return None  # a parent that takes no new file: no claim, as no lock
            raise
    return read_claim(store) or {}


def _claimed_here(doc: dict) -> bool:
    """Whether this process made the claim `doc` (the same pid, start time, host and boot)."""
    return (doc.get("pid") == os.getpid() and doc.get("pid_start") == _start_ticks(os.getpid()) != ""
            and doc.get("host") == socket.gethostname() and doc.get("boot_id") == _boot_id())


def release_claim(store: Store, save_id: str | None = None) -> None:
    """Delete `store`'s save claim (only if it names `save_id`, when given). Best effort: a claim
    left behind only keeps other saves out of a directory that is committed or removed."""
    place = _claim_place(store)
    if place is None:
        return
    at, key = place
    try:
        if save_id is not None:
            doc = read_claim(store)
            if doc is None or doc.get("save_id") != save_id:
                return
        at.delete(key)
    except StorageError:
        pass


def claim_holder(doc: dict) -> str:
    """Who made a save claim, for a refusal's message."""
    return _who(json.dumps(doc).encode())

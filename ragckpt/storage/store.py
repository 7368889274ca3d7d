"""One small storage layer: whole-object atomic writes, range reads, create-if-absent markers.

Local paths get a direct POSIX backend because local disks are the hot path: in-place writes (large
objects with O_DIRECT, see `ragckpt.storage.direct`), one file-system sync before the commit marker,
and `os.preadv` range reads into caller memory. Every other URL goes through fsspec (`s3://` via
s3fs), see `ragckpt.storage.remote`; both implement `ragckpt.storage.base.Store`. Keys are
'/'-separated paths relative to the checkpoint root.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import shutil
import stat
import threading
import uuid
from collections.abc import Iterator, Sequence
from urllib.parse import unquote

import numpy as np

from ragckpt.cpus import usable_cpus
from ragckpt.errors import BadObjectError, DestinationExistsError, DestinationReplacedError, StorageError
from ragckpt.storage import direct
from ragckpt.storage.base import UNREADABLE, Buffer, Store, split_views
from ragckpt.storage.checksum import crc32c, pieces_crc
from ragckpt.storage.config import io_config
from ragckpt.storage.pagecache import page_cached
from ragckpt.storage.remote import open_remote

try:  # syncfs(2): flush one file system, not every mounted one
    import ctypes

    _libc = ctypes.CDLL(None, use_errno=True)
    _libc.syncfs  # noqa: B018 - probe for the symbol
except (OSError, AttributeError):  # pragma: no cover - non-glibc platforms
    _libc = None

#: a checksummed read from local files lands in pieces of this size, each checksummed as soon as it
#: lands: after the kernel's copy of a 1 MiB block much of it has left a 2 MiB L2 cache, and crc32c
#: ran at 23 GB/s per core, against 54 GB/s on 256 KiB pieces (12 from memory, 85 from a hot cache).
#: Smaller pieces cost more in per-call overhead than they save. Rank processes restoring 8 x 124
#: MiB from the page cache: 0.72x a plain file read with 1 MiB pieces, 0.80x with 256 KiB.
CACHE_PIECE_BYTES = 256 << 10
#: the piece size when more threads of this process read than it has CPUs (`ragckpt.cpus`: a
#: container's CPU quota counts, not the host's cores it sees): a reader that waits for
#: the GIL after each read finds its piece evicted by the threads that ran meanwhile, so it pays for
#: more calls and gains no cache hits (8 reader threads on 2 cores: 256 KiB pieces loaded at 0.70x
#: a plain file read, 512 KiB at 0.75x, 1 MiB at 0.73x). From a cold page cache those 8 threads also
#: read slower in 256 KiB pieces (1.94 against 2.18 GB/s); in 512 KiB pieces they read at 2.19, as
#: do 8 processes or 2 threads in 256 KiB pieces.
CROWDED_PIECE_BYTES = 512 << 10
_CORES = usable_cpus()
#: buffers one `preadv` may take (the Linux limit)
_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024


_readers = 0  # threads of this process in LocalStore.read_block_crcs
_readers_lock = threading.Lock()


def _verify_piece(block_bytes: int) -> int:
    """The piece size for a checksummed local read of `block_bytes` blocks (see CACHE_PIECE_BYTES),
    whole blocks where it does not divide them."""
    piece = CACHE_PIECE_BYTES if _readers <= _CORES else CROWDED_PIECE_BYTES
    return piece if block_bytes % piece == 0 else block_bytes


def _cached(fd: int, pos: int) -> bool:
    """Whether the page at `pos` of `fd` is in the page cache (`pagecache.page_cached`, which leaves
    the cache as it was); True where that cannot be told, so the range is read buffered as before."""
    return page_cached(fd, pos) is not False


def _pread_failed(path: str, e: OSError) -> StorageError:
    """A read of an open object failed (an I/O error): the file system failing, not the data."""
    return StorageError(f"cannot read {path}: {e.strerror or e}")


def _preadv_all(fd: int, path: str, views: Sequence[memoryview], pos: int, span: tuple[int, int]) -> int:
    """Fill `views` from `fd` at `pos`, resuming short reads; returns the position after them. `span`
    is the whole range being read, for the error that names a truncated object."""
    todo, i = list(views), 0
    while i < len(todo):
        try:
            n = os.preadv(fd, todo[i : i + _IOV_MAX], pos)
        except OSError as e:
            raise _pread_failed(path, e) from e
        if n == 0:
            raise BadObjectError(f"object {path} is truncated: wanted bytes [{span[0]}, {span[1]}), file ends at {pos}")
        pos += n
        while i < len(todo) and n >= len(todo[i]):  # what landed; a short read resumes mid-view
            n -= len(todo[i])
            i += 1
        if n:
            todo[i] = todo[i][n:]
    return pos


def _piece_block_crcs(fd: int, path: str, start: int, out: memoryview, block_bytes: int,
                      piece: int) -> Iterator[int]:
    """The crc of every block of `out`, filled from `fd` at `start` in reads of `piece` bytes (a
    divisor of `block_bytes`). Nothing per piece but the read and the checksum: a warm restore runs
    this loop for every 256 KiB."""
    size = len(out)
    span = (start, start + size)
    preadv = os.preadv
    for b in range(0, size, block_bytes):
        crc = 0
        for p in range(b, min(b + block_bytes, size), piece):
            v = out[p : p + piece]
            try:
                n = preadv(fd, (v,), start + p)
            except OSError as e:
                raise _pread_failed(path, e) from e
            if n != len(v):  # resumed, or named as a truncated object, by the general loop
                _preadv_all(fd, path, (v[n:],), start + p + n, span)
            crc = crc32c(v, crc)
        yield crc


def _scatter_pieces(fd: int, path: str, start: int, views: Sequence[memoryview],
                    piece_bytes: int) -> Iterator[list[memoryview]]:
    """Fill `views` (in order) from `fd` at `start`, a `preadv` per piece of `piece_bytes`, the kernel
    scattering the bytes straight into place; yields each piece's views once they are filled."""
    span = (start, start + sum(len(v) for v in views))
    for part in split_views(views, piece_bytes):
        start = _preadv_all(fd, path, part, start, span)
        yield part


def _scatter_block_crcs(fd: int, path: str, start: int, views: Sequence[memoryview],
                        block_bytes: int) -> Iterator[int]:
    """The crc of every block of the range filled into `views` from `fd` at `start`, read a checksum
    piece at a time (`_scatter_pieces`)."""
    crc, filled = 0, 0  # pieces divide blocks: a block's pieces end on its end
    for part in _scatter_pieces(fd, path, start, views, _verify_piece(block_bytes)):
        crc = pieces_crc(part, crc)
        filled += sum(len(v) for v in part)
        if filled == block_bytes:
            yield crc
            crc, filled = 0, 0
    if filled:
        yield crc


def _buffered_block_crcs(fd: int, path: str, start: int, views: Sequence[memoryview], block_bytes: int,
                         piece: int) -> Iterator[int]:
    """`read_block_crcs` of one range through the page cache: a single view in reads of `piece`
    bytes, several views scattered a checksum piece at a time."""
    if len(views) == 1:
        return _piece_block_crcs(fd, path, start, views[0], block_bytes, piece)
    return _scatter_block_crcs(fd, path, start, views, block_bytes)


def missing_dirs(path: str) -> list[str]:
    """`path` and those of its ancestors that do not exist yet, deepest first: what
    `os.makedirs(path)` will create."""
    missing = []
    while not os.path.exists(path) and os.path.dirname(path) != path:
        missing.append(path)
        path = os.path.dirname(path)
    return missing


def fsync_dir(path: str) -> None:
    """Make a directory's entries (new names, renames) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalStore(Store):
    """POSIX files. Durability is deferred to `sync()`, which fsyncs the objects written since the last
    sync (or flushes the file system once when there are thousands); the commit marker is written
    after `sync()`, fsynced, and linked into place create-if-absent."""

    # Up to this many objects written since the last sync are fsynced one by one (a rank's save
    # touches a handful, and must not wait for other ranks' I/O); more than that, as when one process
    # writes thousands of rank objects, and one syncfs of the file system is far cheaper.
    FSYNC_EACH_MAX = 64

    zero_copy_reads = True

    def __init__(self, root: str, *, direct_io: bool = True):
        self.root = os.path.abspath(root)
        self.url = self.root
        # large data objects bypass the page cache (see ragckpt.storage.direct); turned off for good
        # the first time this file system refuses O_DIRECT
        self.direct_io = direct_io and direct.O_DIRECT is not None
        self._written: list[str] = []
        # directories this store created (the root and its missing parents among them): their
        # entries in their parents must be made durable too, or a power loss could drop the whole
        # new checkpoint
        self._created: set[str] = set()
        self._lock = threading.Lock()
        self._pinned: tuple[int, int] | None = None  # (st_dev, st_ino) of the root, see pin_root

    def _makedirs(self, d: str) -> None:
        missing = missing_dirs(d)
        os.makedirs(d, exist_ok=True)
        with self._lock:
            self._created.update(missing)

    def _path(self, key: str) -> str:
        return os.path.join(self.root, *key.split("/"))

    def _root_identity(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.root)
        except FileNotFoundError:
            return None
        return st.st_dev, st.st_ino

    def pin_root(self, identity: tuple[int, int] | None = None) -> tuple[int, int] | None:
        """Objects are opened by path: when another job's --overwrite sets this root aside and makes
        a new one at the same path, a job still writing would put its objects into the other job's
        checkpoint (committed, its checksums then failing). Once pinned, every write first checks
        that the path still names the pinned directory, and stops with DestinationReplacedError."""
        now = self._root_identity()
        self._pinned = tuple(identity) if identity is not None else now  # type: ignore[assignment]
        self._check_pinned()
        return self._pinned

    def _check_pinned(self) -> None:
        if self._pinned is not None and self._root_identity() != self._pinned:
            raise DestinationReplacedError(f"{self.root} was replaced by another job while this one was writing into "
                                           "it (another --overwrite?); this job stopped, and the other job's checkpoint "
                                           "there is not this one's. Make sure one job at a time writes there")

    def write(self, key: str, parts: Sequence[Buffer], *, create_only: bool = False, atomic: bool = False) -> None:
        path = self._path(key)
        d = os.path.dirname(path)
        # Data objects are written in place: a torn object can only exist in an uncommitted
        # checkpoint, which readers refuse, and sizes and checksums catch it anyway. The commit
        # marker needs create-if-absent atomicity (written whole to a temp name, then hard-linked),
        # `atomic` objects replace-atomicity (a temp name, then renamed over the old one).
        target = f"{path}.{uuid.uuid4().hex}.tmp" if create_only or atomic else path
        views = [memoryview(p).cast("B") for p in parts]
        self._check_pinned()
        try:
            if target == path and self.direct_io and sum(len(v) for v in views) >= direct.MIN_BYTES:
                if self._write_direct(path, d, views):
                    return
            try:
                fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            except FileNotFoundError:
                self._makedirs(d)
                fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                for mv in views:
                    while len(mv):
                        n = os.write(fd, mv)
                        mv = mv[n:]
                if create_only:
                    os.fsync(fd)
            finally:
                os.close(fd)
            if atomic and not create_only:
                os.replace(target, path)
            if not create_only:
                with self._lock:
                    self._written.append(path)
            else:
                try:
                    os.link(target, path)  # atomic create-if-absent
                except FileExistsError:
                    raise DestinationExistsError(self._taken(key)) from None
                finally:
                    os.unlink(target)
                fsync_dir(d)
        except OSError as e:
            if target != path:
                try:
                    os.unlink(target)
                except OSError:
                    pass
            raise StorageError(f"cannot write {path}: {e.strerror or e}") from e

    def _taken(self, key: str) -> str:
        """Why a create-if-absent write of `key` found something there: another writer's object, or
        a damaged entry (a dangling symlink, a directory) that no writer made and none may replace."""
        path = self._path(key)
        problem = self.object_problem(key)
        if problem is not None:
            return (f"{path} is already there but is {problem}, not a regular file: the checkpoint is damaged; "
                    "remove it and re-run the save, or save into a new directory")
        return f"{path} already exists; another writer committed first"

    def _write_direct(self, path: str, d: str, views: list[memoryview]) -> bool:
        """Write with O_DIRECT; False (and buffered from now on) where the file system refuses it."""
        try:
            try:
                direct.write_direct(path, views)
            except FileNotFoundError:
                self._makedirs(d)
                direct.write_direct(path, views)
        except direct.DirectUnsupported:
            self.direct_io = False
            return False
        except OSError as e:
            if e.errno == errno.EINVAL:  # refused mid-file: unusual alignment rules on this file system
                raise StorageError(f"cannot write {path} with O_DIRECT: {e.strerror or e}; set RAGCKPT_IO_DIRECT=0 "
                                   "(or -o ragckpt.direct_io=false) to write buffered") from e
            raise
        with self._lock:
            self._written.append(path)
        return True

    def sync(self) -> None:
        with self._lock:
            written, self._written = self._written, []
            created, self._created = self._created, set()
        if not os.path.isdir(self.root):
            return
        if len(written) <= self.FSYNC_EACH_MAX:
            # every directory up to the root (new entries), and the parent of every directory this
            # store created, above the root too
            dirs: set[str] = set()
            for p in written:
                d = os.path.dirname(p)
                while d.startswith(self.root) and d not in dirs:
                    dirs.add(d)
                    d = os.path.dirname(d)
            dirs |= {os.path.dirname(c) for c in created}
            for path in [*written, *sorted(dirs, key=len, reverse=True)]:
                try:
                    fd = os.open(path, os.O_RDONLY)
                except FileNotFoundError:  # written by this job moments ago
                    raise StorageError(f"{path} vanished before it was flushed to disk: another job is writing "
                                       f"into {self.root} at the same time, or removed it; let one job finish, then "
                                       "re-run") from None
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            return
        fd = os.open(self.root, os.O_RDONLY)
        try:
            if _libc is not None:
                if _libc.syncfs(fd) == 0:
                    return
                err = ctypes.get_errno()
                if err != errno.ENOSYS:  # a write-back error (EIO, ENOSPC, EDQUOT): the data is not safe
                    raise StorageError(f"cannot flush {self.root} to disk: {os.strerror(err)}; the checkpoint "
                                       "is not durable and was not committed")
        finally:
            os.close(fd)
        os.sync()

    def _open_object(self, path: str) -> int:
        """A read descriptor of the regular file `path`. Opened without blocking and checked: a FIFO
        put where an object should be would otherwise hang the reader for good, and a directory or
        device read as an object gives errors that name no cause."""
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        except FileNotFoundError:
            raise BadObjectError(self._missing(path)) from None
        except OSError as e:  # a symlink loop, no permission, ...
            raise _read_error(path, e) from e
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            os.close(fd)
            raise BadObjectError(f"object {path} is {_mode_kind(mode)}, not a regular file")
        return fd

    @staticmethod
    def _missing(path: str) -> str:
        """The message for an object that cannot be found: a dangling symlink is named as one, since
        "missing" would send the user looking for a file whose entry is right there."""
        link = _dangling_link(path)
        if link is not None:
            return f"object {path} is {link}, not a regular file"
        return f"object {path} is missing"

    def object_problem(self, key: str) -> str | None:
        path = self._path(key)
        try:
            mode = os.stat(path).st_mode
        except FileNotFoundError:
            return _dangling_link(path)
        except OSError as e:
            if e.errno == errno.ELOOP:
                return "a symlink loop"
            return None  # no permission on the way: the read that follows says so
        return None if stat.S_ISREG(mode) else _mode_kind(mode)

    def read(self, key: str) -> bytes:
        path = self._path(key)
        fd = self._open_object(path)
        try:
            with os.fdopen(fd, "rb") as f:
                return f.read()
        except OSError as e:
            raise _pread_failed(path, e) from e

    def read_range(self, key: str, start: int, stop: int) -> memoryview:
        # uninitialised memory: a zero-filled bytearray would cost one more pass over every byte read
        out = memoryview(np.empty(stop - start, dtype=np.uint8))
        self.read_range_into(key, start, out)
        return out

    def read_range_into(self, key: str, start: int, out: memoryview) -> None:
        for _ in self.read_range_pieces(key, start, out, max(1, len(out))):
            pass

    def read_range_scatter(self, key: str, start: int, views: Sequence[memoryview],
                           piece_bytes: int) -> Iterator[list[memoryview]]:
        # one open file for the whole range, one read per piece: a piece read from the page cache is
        # still in the CPU cache when the caller checksums it
        path = self._path(key)
        fd = self._open_object(path)
        try:
            yield from _scatter_pieces(fd, path, start, views, piece_bytes)
        finally:
            os.close(fd)

    def read_block_crcs(self, items: Sequence[tuple[str, int, Sequence[memoryview]]],
                        block_bytes: int) -> Iterator[int]:
        global _readers
        with _readers_lock:
            _readers += 1
        try:
            # one open per object: an exact read of short pieces (a reshard's `read_pieces`) gives many
            # items of one object in a row, and opening it for each cost as much as reading
            short = min(CACHE_PIECE_BYTES, block_bytes)  # one crc for one read
            for key, group in itertools.groupby(items, key=lambda item: item[0]):
                path = self._path(key)
                fd = self._open_object(path)
                try:
                    for _, start, views in group:
                        if len(views) == 1 and len(views[0]) <= short:
                            # a short piece is one read either way: no probe, no generator frames (an
                            # exact read of a reshard's short stretches makes tens of thousands); a
                            # short read or an error goes the general way, which resumes or names it
                            v = views[0]
                            try:
                                done = os.preadv(fd, (v,), start) == len(v)
                            except OSError:
                                done = False
                            if done:
                                yield crc32c(v)
                                continue
                        yield from self._views_block_crcs(fd, path, start, views, block_bytes)
                finally:
                    os.close(fd)
        finally:
            with _readers_lock:
                _readers -= 1

    def _views_block_crcs(self, fd: int, path: str, start: int, views: Sequence[memoryview],
                          block_bytes: int) -> Iterator[int]:
        """`read_block_crcs` of one range, into one view (an engine's restore of a whole rank buffer)
        or several (a reshard's runs, scattered into place). From the page cache it reads pieces that
        are still in the CPU cache when checksummed, and does nothing per piece but the read and the
        checksum. A probe tells whether the first page is cached; when it is not (a restart), the
        page cache is no help, and the range is read with O_DIRECT (`_direct_block_crcs`), or where
        that is off or refused, a whole block at a time (docs/STORAGE.md has the measurements)."""
        views = [memoryview(v).cast("B") for v in views]
        size, piece = sum(len(v) for v in views), _verify_piece(block_bytes)
        may_direct = self.direct_io and size >= direct.MIN_READ_BYTES and start % direct.ALIGN == 0
        # probed only where the answer changes the read (several views are read the same way cold or
        # warm unless they go direct), and never for a range of one piece, one read either way (a
        # resharder reads thousands of them)
        cold = (may_direct or len(views) == 1) and size > piece and not _cached(fd, start)
        if cold and may_direct:
            try:
                yield from self._direct_block_crcs(fd, path, start, views, block_bytes)
            finally:  # the descriptor reads the object's next range buffered unless that one goes direct too
                with contextlib.suppress(OSError, direct.DirectUnsupported):
                    direct.set_direct(fd, False)
        else:
            yield from _buffered_block_crcs(fd, path, start, views, block_bytes, block_bytes if cold else piece)

    def _direct_block_crcs(self, fd: int, path: str, start: int, views: Sequence[memoryview],
                           block_bytes: int) -> Iterator[int]:
        """A cold range read with O_DIRECT, up to 8 MiB per request (the kernel splits a request for
        the device, so one keeps about as much in flight as a buffered reader's readahead), each
        block's crc taken as its bytes land: straight into a single view (through the bounce buffer
        where it is not page-aligned), or for several views into the thread's bounce buffer and
        copied from there into place. The last partial page is read buffered. A file system that
        refuses O_DIRECT turns it off for this store, and the range is read buffered."""
        one = views[0] if len(views) == 1 else None
        size = sum(len(v) for v in views)
        span = (start, start + size)
        body = size - size % direct.ALIGN  # what direct reads land; the rest, under a page, is read buffered
        try:
            direct.set_direct(fd, True)
        except direct.DirectUnsupported:
            self.direct_io = False
            yield from _buffered_block_crcs(fd, path, start, views, block_bytes, block_bytes)
            return
        bounce = direct.bounce() if one is None else None
        # with several views: the views each bounce-buffer load is copied into
        places = split_views(views, direct.BOUNCE_BYTES) if bounce is not None else None
        on, crc, block_end = True, 0, min(block_bytes, size)
        for r in range(0, size, direct.BOUNCE_BYTES):
            e = min(r + direct.BOUNCE_BYTES, size)
            land = one[r:e] if bounce is None else bounce[: e - r]
            got = 0
            if on and min(e, body) > r:
                try:
                    got = direct.read_direct(fd, start + r, land[: min(e, body) - r], first=r == 0)
                except direct.DirectUnsupported:  # the first read was refused: nothing yielded yet
                    self.direct_io = False
                    direct.set_direct(fd, False)
                    yield from _buffered_block_crcs(fd, path, start, views, block_bytes, block_bytes)
                    return
                except OSError as err:
                    raise _pread_failed(path, err) from err
            if got < e - r:  # the last page, or a short read: resumed buffered, or named as a truncated object
                if on:
                    direct.set_direct(fd, False)
                    on = False
                _preadv_all(fd, path, (land[got:],), start + r + got, span)
            p = r
            while p < e:
                q = min(e, block_end)
                crc = crc32c(land[p - r : q - r], crc)
                p = q
                if q == block_end:
                    yield crc
                    crc, block_end = 0, min(q + block_bytes, size)
            if places is not None:
                p = 0
                for v in next(places):  # numpy copies with the GIL released
                    np.copyto(np.frombuffer(v, np.uint8), np.frombuffer(land[p : p + len(v)], np.uint8))
                    p += len(v)

    def exists(self, key: str) -> bool:
        # lexists: a dangling symlink is an entry, not free space (`Store.exists`)
        return os.path.lexists(self._path(key))

    def size(self, key: str) -> int:
        try:
            return os.path.getsize(self._path(key))
        except FileNotFoundError:
            raise BadObjectError(self._missing(self._path(key))) from None
        except OSError as e:  # a symlink loop, no permission on the directory
            raise _read_error(self._path(key), e) from e

    def check_root(self) -> None:
        # os.path.exists answers False where a directory on the way cannot be searched: say so,
        # rather than "no checkpoint here"
        for path in (self.root, os.path.join(self.root, "zarr.json")):
            try:
                os.stat(path)
            except PermissionError:
                raise StorageError(f"cannot read {self.root}: permission denied; check its permissions (and its "
                                   "parent directories'), or run as a user that can read it") from None
            except OSError:
                return
        if os.path.isdir(self.root) and not os.access(self.root, os.R_OK):
            raise StorageError(f"cannot list {self.root}: permission denied; check its permissions, or run as a "
                               "user that can read it")

    def walk(self, prefix: str = "") -> Iterator[tuple[str, list[str], list[str]]]:
        """`os.walk` under `prefix`: (directory key relative to the root, '' for the root itself, its
        subdirectory names, its file names). Prune by editing the subdirectory list in place. A
        directory that cannot be read raises StorageError rather than looking empty; a missing one
        holds nothing."""
        base = self._path(prefix) if prefix else self.root

        def unreadable(e: OSError) -> None:
            if isinstance(e, (FileNotFoundError, NotADirectoryError)):  # absent, or vanished meanwhile
                return
            reason = "permission denied" if isinstance(e, PermissionError) else (e.strerror or str(e))
            raise StorageError(f"cannot list {e.filename or base}: {reason}; check its permissions, or run as a "
                               "user that can read it")

        for dirpath, dirs, files in os.walk(base, onerror=unreadable):
            rel = os.path.relpath(dirpath, self.root)
            yield ("" if rel == "." else rel.replace(os.sep, "/")), dirs, files

    def list(self, prefix: str = "") -> list[str]:
        return sorted(f"{rel}/{f}" if rel else f for rel, _, files in self.walk(prefix) for f in files)

    def list_sizes(self, prefix: str = "") -> dict[str, int]:
        """As `Store.list_sizes`, with `UNREADABLE` for an entry that cannot be stat'ed because of
        what is stored (a broken link, a link loop): a checker reports that object and goes on with
        the others. Any other failure (no permission, an I/O error) is the file system's, not damage,
        and raises `StorageError`."""
        out = {}
        for key in self.list(prefix):
            path = self._path(key)
            try:
                out[key] = os.stat(path).st_size
            except OSError as e:
                if e.errno not in (errno.ENOENT, *_DAMAGE_ERRNOS):
                    raise _read_error(path, e) from e
                out[key] = UNREADABLE
        return out

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            os.unlink(path)
        except (FileNotFoundError, NotADirectoryError):
            return
        except OSError as e:
            raise StorageError(f"cannot delete {path}: {e.strerror or e}") from e
        fsync_dir(os.path.dirname(path))

    def delete_many(self, keys: Sequence[str]) -> None:
        """Also removes the directories the deletions left empty (below the root): zarr-python warns
        about every empty directory in a group, as a component it cannot recognise."""
        super().delete_many(keys)
        emptied = {os.path.dirname(self._path(k)) for k in keys}
        root = os.path.abspath(self.root)
        for d in sorted(emptied, key=len, reverse=True):
            d = os.path.abspath(d)
            while d != root and d.startswith(root + os.sep):
                try:
                    os.rmdir(d)
                except OSError:  # not empty (or gone already): its parents are not empty either
                    break
                fsync_dir(os.path.dirname(d))
                d = os.path.dirname(d)

    def _delete_rest(self, keep: set[str]) -> None:
        # the contents, not the directory: it may be a mount point, or carry an owner and mode the
        # user chose. Kept keys are top-level objects (the commit marker, the root document).
        try:
            # a mount point's lost+found is the file system's, not the checkpoint's
            skip = keep | ({"lost+found"} if os.path.ismount(self.root) else set())
            entries = [e for e in os.scandir(self.root) if e.name not in skip]
        except (FileNotFoundError, NotADirectoryError):
            return
        def gone_is_fine(_fn: object, _path: str, exc: tuple) -> None:
            if not isinstance(exc[1], FileNotFoundError):
                raise exc[1]

        for e in entries:
            try:
                if e.is_dir(follow_symlinks=False):
                    shutil.rmtree(e.path, onerror=gone_is_fine)
                else:
                    os.unlink(e.path)
            except FileNotFoundError:
                continue
            except OSError as err:
                if err.errno != errno.ENOTEMPTY:  # the callers word other failures with what they did
                    raise
                # "directory not empty" after rmtree emptied it: something is writing into it right now
                raise StorageError(f"cannot delete {e.path}: {err.strerror or err} (is another job writing into "
                                   f"{self.root} at the same time?); let one job finish, then re-run") from err


def _mode_kind(mode: int) -> str:
    """What a file of `mode` is, in words, for "X is ..., not a regular file"."""
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a pipe"
    return "a special file (a socket or device)"


def _dangling_link(path: str) -> str | None:
    """"a dangling symlink to T" when `path` is a symlink whose target does not exist, else None."""
    try:
        return f"a dangling symlink to {os.readlink(path)}"
    except OSError:  # not a link (absent, or a plain file that appeared meanwhile)
        return None


def as_url(url: str | os.PathLike) -> str:
    """A checkpoint location as text: a `pathlib.Path` (any `os.PathLike`) is its path, as for open();
    anything else but a str is a TypeError that names what was given."""
    if isinstance(url, str):
        return url
    if isinstance(url, os.PathLike):
        path = os.fspath(url)
        if isinstance(path, str):
            return path
    raise TypeError(f"the checkpoint path or URL must be a str or a path, got {type(url).__name__} {url!r}")


def local_path(url: str) -> str | None:
    """The local path `url` names: itself when it has no scheme; for file:// URLs the path after the
    host, which must be empty or `localhost` (`file:///p` and `file://localhost/p` are both `/p`).
    None for any other URL. A file:// URL naming another host is refused: taken as a path, it would
    be a relative directory named after the host, and a write would land there. A URL's path is
    percent-decoded (`Path.as_uri()` writes a space as `%20`); a plain path is taken as it is."""
    url = as_url(url)
    if url[:7].lower() != "file://":
        if url[:6].lower() == "file:/":  # RFC 8089's minimal form, file:/p
            return unquote(url[5:])
        return None if "://" in url else url
    rest = url[7:]
    if rest.startswith("/"):
        return unquote(rest)
    host, sep, tail = rest.partition("/")
    if host.lower() == "localhost" and sep:
        return unquote("/" + tail)
    what = f"names host '{host}'" if host and host.lower() != "localhost" else "names no path"
    raise StorageError(f"{url} {what}: a file:// URL is a file on this machine; write file:///path (three "
                       "slashes) or a plain path")


#: failures of an open or stat that come from what is stored, not from the file system
_DAMAGE_ERRNOS = (errno.ELOOP, errno.ENOTDIR, errno.EISDIR)


def _read_error(path: str, e: OSError) -> StorageError:
    """A failed open or stat of an object: a link loop or a file where a directory should be is
    damage to what is stored (`BadObjectError`); anything else (no permission, an I/O error) is the
    file system failing."""
    cls = BadObjectError if e.errno in _DAMAGE_ERRNOS else StorageError
    return cls(f"cannot read {path}: {e.strerror or e}")


def open_store(url: str, storage_options: dict | None = None) -> Store:
    """The store for a URL: a local path or file:// gets `LocalStore`, s3:// `S3Store`, anything else
    fsspec (see `ragckpt.storage.remote`)."""
    url = as_url(url)
    if url == "":
        # "" would otherwise be the current directory: a script's unset variable must not read or
        # list whatever happens to be there
        raise ValueError("the checkpoint path or URL is an empty string (an unset variable?); give a path or URL")
    path = local_path(url)
    if path is not None:
        return LocalStore(path, direct_io=io_config(storage_options).direct_io)
    return open_remote(url, storage_options or {})

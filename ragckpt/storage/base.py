"""The `Store` interface every backend implements (local files in `storage.store`, object stores in
`storage.remote`), on its own so that both build on it and `open_store` can pick between them.
Keys are '/'-separated paths relative to the checkpoint root.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence

from ragckpt.storage.checksum import pieces_crc

Buffer = bytes | bytearray | memoryview

#: range-read batch for local files: 4 MiB was measured fastest (the fetched bytes are checksummed and
#: scattered while still in the CPU cache)
LOCAL_FETCH_BYTES = 4 << 20


def split_views(views: Sequence[memoryview], piece_bytes: int) -> Iterator[list[memoryview]]:
    """Consecutive views regrouped into pieces of `piece_bytes` bytes (the last may be short), a view
    cut where a piece ends; empty views are dropped."""
    part: list[memoryview] = []
    room = piece_bytes
    for v in views:
        v = memoryview(v).cast("B")
        while len(v):
            take = v[:room]
            part.append(take)
            v = v[len(take):]
            room -= len(take)
            if room == 0:
                yield part
                part, room = [], piece_bytes
    if part:
        yield part


#: the size `list_sizes` gives an object that is listed but cannot be read
UNREADABLE = -1


class Store(ABC):
    """A checkpoint root. Subclasses implement the primitive operations."""

    url: str

    #: range reads land in caller memory with no intermediate copy (local files: `preadv`), so
    #: readers gain by reading aligned ranges straight into their destination
    zero_copy_reads = False
    #: reads gain from many requests in flight together (object stores: each request waits a round
    #: trip and moves one connection's worth of bytes), so readers hand the store all they can at once
    concurrent_reads = False
    #: `write(create_only=True)` is atomic: of two concurrent creators exactly one succeeds
    atomic_create = True

    @property
    def fetch_bytes(self) -> int:
        """How many bytes a reader should ask for per batch of range reads. Object stores need many
        requests in flight to reach their bandwidth, so they get large batches (remote.py); local
        files are best read in small batches whose checksum and scatter passes run from the CPU cache."""
        return LOCAL_FETCH_BYTES

    @abstractmethod
    def write(self, key: str, parts: Sequence[Buffer], *, create_only: bool = False, atomic: bool = False) -> None:
        """Write one whole object from the concatenation of `parts`. With `create_only`, fail with
        DestinationExistsError if the object already exists. Object stores replace objects whole;
        local files are written in place (a torn object can only be part of an uncommitted
        checkpoint) unless `atomic`, which writes a temporary name and renames it into place, for
        the few objects rewritten beside a committed checkpoint's readers."""

    @abstractmethod
    def read(self, key: str) -> bytes: ...

    @abstractmethod
    def read_range(self, key: str, start: int, stop: int) -> Buffer: ...

    def read_ranges(self, reqs: Sequence[tuple[str, int, int]]) -> list[Buffer]:
        """Many range reads; remote stores run them concurrently."""
        return [self.read_range(k, a, b) for k, a, b in reqs]

    def read_many(self, keys: Sequence[str]) -> list[bytes]:
        """Many whole (small) objects, in order; remote stores fetch them concurrently. The
        committer reads one document per rank: 8,192 requests one after another on S3."""
        return [self.read(k) for k in keys]

    def read_range_into(self, key: str, start: int, out: memoryview) -> None:
        """Read `len(out)` bytes at `start` straight into caller memory (local: no copy)."""
        out[:] = self.read_range(key, start, start + len(out))

    def read_ranges_into(self, reqs: Sequence[tuple[str, int, memoryview]]) -> None:
        """`read_range_into` of every `(key, start, view)`; remote stores run them concurrently."""
        for key, start, view in reqs:
            self.read_range_into(key, start, view)

    def read_into_views(self, key: str, start: int, views: Sequence[memoryview]) -> None:
        """Fill `views`, in order, from consecutive bytes of `key` at `start`: one view straight,
        several through one staging read."""
        if len(views) == 1:
            self.read_range_into(key, start, views[0])
            return
        data = memoryview(self.read_range(key, start, start + sum(len(v) for v in views))).cast("B")
        p = 0
        for v in views:
            v[:] = data[p : p + len(v)]
            p += len(v)

    def read_range_pieces(self, key: str, start: int, out: memoryview, piece_bytes: int) -> Iterator[memoryview]:
        """Fill `out` from `key` at `start`, yielding each `piece_bytes` piece of it (the last may be
        short) as soon as it has landed, so a caller can checksum it while it is still in the CPU
        cache: verifying after the whole read would pass over memory twice. `read_range_scatter`
        with one view."""
        for part in self.read_range_scatter(key, start, [out], piece_bytes):
            yield part[0]

    def read_range_scatter(self, key: str, start: int, views: Sequence[memoryview],
                           piece_bytes: int) -> Iterator[list[memoryview]]:
        """Fill `views`, in order, from consecutive bytes of `key` at `start`, yielding the views of
        each `piece_bytes` piece as soon as it has landed. Object stores fetch `fetch_bytes` per
        request (straight into a view that holds the whole fetch, else copied into the views) and
        yield the pieces of each; local files override this with a `preadv` per piece, the kernel
        scattering straight into the views."""
        span = max(piece_bytes, (self.fetch_bytes // piece_bytes) * piece_bytes)
        for fetched in split_views(views, span):
            self.read_into_views(key, start, fetched)
            start += sum(len(v) for v in fetched)
            yield from split_views(fetched, piece_bytes)

    def read_scatter_blocks(self, items: Sequence[tuple[str, int, Sequence[memoryview]]],
                            piece_bytes: int) -> Iterator[list[memoryview]]:
        """`read_range_scatter` of every `(key, start, views)` in turn: the pieces of a range that
        runs over several objects, in order. Object stores override it to keep the requests of
        several objects in flight together."""
        for key, start, views in items:
            yield from self.read_range_scatter(key, start, views, piece_bytes)

    def read_block_crcs(self, items: Sequence[tuple[str, int, Sequence[memoryview]]],
                        block_bytes: int) -> Iterator[int]:
        """`read_scatter_blocks(items, block_bytes)`, yielding the crc32c of each block as it lands
        instead of its views: the checksummed read. Local files checksum each block in pieces while
        they are in the CPU cache."""
        got = self.read_scatter_blocks(items, block_bytes)
        try:
            for block in got:
                yield pieces_crc(block)
        finally:
            got.close()

    def write_many(self, items: Iterable[tuple[str, Sequence[Buffer]]]) -> None:
        for key, parts in items:
            self.write(key, parts)

    @abstractmethod
    def exists(self, key: str) -> bool:
        """Whether anything is at `key`, readable or not: writers must never take a damaged entry
        (a dangling symlink where the commit marker should be) for free space."""

    def object_problem(self, key: str) -> str | None:
        """Why the entry at `key` is no readable object ("a directory", "a pipe", "a dangling symlink
        to ..."), or None when it is a regular object or absent. Object stores hold nothing but
        objects, so only local files can answer otherwise; readers ask it of the commit marker, whose
        damage must not pass for "not committed"."""
        return None

    def size_problem(self, key: str, size: int | None, expected: int) -> str:
        """Why a listed `size` (None: not listed; UNREADABLE: could not be stat'ed) of the object at
        `key` is not `expected`, as "object URL <why>": an entry of the wrong kind is named as one
        (a directory, a pipe, a dangling symlink), since "missing" or "0 bytes" would send the user
        looking for the wrong thing."""
        kind = self.object_problem(key)
        if kind is not None:
            why = f"is {kind}, not a regular file"
        elif size is None:
            why = "is missing"
        elif size == UNREADABLE:
            why = "cannot be read (a broken link or a link loop)"
        else:
            why = f"has {size} bytes, expected {expected}"
        return f"object {self.child(key)} {why}"

    @abstractmethod
    def size(self, key: str) -> int: ...

    @abstractmethod
    def list(self, prefix: str = "") -> list[str]:
        """Keys under `prefix` (recursive), relative to the root."""

    def list_sizes(self, prefix: str = "") -> dict[str, int]:
        """Every key under `prefix` with its size in bytes. Object stores answer from the listing
        itself (one request per 1,000 keys), where asking each object's size is a request each."""
        return {k: self.size(k) for k in self.list(prefix)}

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove one object, durably; an absent one is no error."""

    def delete_many(self, keys: Sequence[str]) -> None:
        """Remove several objects (absent ones are no error); object stores batch the requests."""
        for key in keys:
            self.delete(key)

    def delete_all(self, first: Sequence[str] = (), last: Sequence[str] = ()) -> None:
        """Remove everything under the root (used for --overwrite). The keys in `first` go before
        anything else and those in `last` after everything else, each durably: deleting a
        checkpoint's commit marker first means a crash half way leaves an uncommitted checkpoint,
        never a committed one with objects missing; keeping its root document to the end keeps what
        a re-run needs to recognise the remainder."""
        for key in first:
            self.delete(key)
        self._delete_rest(set(first) | set(last))
        for key in last:
            self.delete(key)

    @abstractmethod
    def _delete_rest(self, keep: set[str]) -> None:
        """Remove every object under the root but those in `keep`."""

    def sync(self) -> None:  # noqa: B027 - optional hook, a no-op where writes are durable on return
        """Make every completed write durable."""

    def hurried(self) -> Store:
        """This store for clean-up after a Ctrl-C or SIGTERM, which a kill may follow within seconds
        (Slurm waits 30 s): object stores make each request one attempt of a few seconds, so that a
        store that stopped answering cannot hold the exit for its whole retry budget."""
        return self

    def abort_uploads(self, *, hurried: bool = False) -> None:  # noqa: B027 - optional hook, a no-op where writes are never partial
        """Abort the unfinished multipart uploads a failed job's writers left under the checkpoint's
        data (object stores that have them)."""

    def pin_root(self, identity: tuple[int, int] | None = None) -> tuple[int, int] | None:
        """Tie every later write to the root as it is now (or to `identity`, the root a coordinator
        pinned), and return its identity. Object stores have no identity to pin: None."""
        return None

    def check_root(self) -> None:  # noqa: B027 - optional hook
        """Raise StorageError when the container itself is missing or unreachable (a bucket that does
        not exist), so that "no checkpoint here" is said only when that is true. Called on error paths."""

    def child(self, key: str) -> str:
        return self.url.rstrip("/") + "/" + key

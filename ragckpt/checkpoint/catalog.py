"""The checkpoints under a directory or prefix, and which of them is the newest committed one.

`ragckpt ls ROOT` and a training job's checkpointer both need the same answer to "what is here, and
in what state": one listing, so a checkpoint the CLI calls incomplete is never one a resume picks.
Rows are plain dicts (the CLI's `--json` document): `url`, `committed`, and with `long` the world
size, layout, tensor count, stored bytes, creation time and user metadata step; a row that could
not be judged has `incomplete`, `damaged` or `unreadable` (the reason) instead.
"""

from __future__ import annotations

import os
import re

from ragckpt.checkpoint import manifest as mf
from ragckpt.errors import AccessDeniedError, BadObjectError, FormatError, StorageError
from ragckpt.format.dtypes import itemsize
from ragckpt.storage.lock import read_claim, release_claim
from ragckpt.storage.store import LocalStore, Store, open_store

#: the directory names a checkpointer gives its saves (`step-<n>`), and the step they carry
STEP_NAME = re.compile(r"^step-(\d+)$")


class NothingThereError(StorageError):
    """A listing's root does not exist or is a file: an empty listing must mean an empty directory,
    never a typo."""


def list_checkpoints(url: str, *, storage_options: dict | None = None, long: bool = False) -> list[dict]:
    """Every checkpoint under `url` (not `url` itself), sorted by URL, never looking inside one."""
    return list_store(open_store(url, storage_options), long)


def latest_committed(rows: list[dict]) -> dict | None:
    """The committed row of the highest `step-<n>` name (what a resume loads), or None."""
    steps = [(step_of(r["url"]), r) for r in rows if r.get("committed")]
    steps = [(s, r) for s, r in steps if s is not None]
    return max(steps, key=lambda sr: sr[0])[1] if steps else None


def step_of(url: str) -> int | None:
    """The step of a `.../step-<n>` URL, None for any other name."""
    m = STEP_NAME.match(url.rstrip("/").rsplit("/", 1)[-1])
    return int(m.group(1)) if m else None


def list_store(store: Store, long: bool) -> list[dict]:
    """`list_checkpoints` of an open store (the CLI has one already)."""
    if isinstance(store, LocalStore):
        return _list_local(store, long)
    return _list_remote(store, long)


def _list_local(store: LocalStore, long: bool) -> list[dict]:
    if not os.path.isdir(store.root):
        store.check_root()  # permission denied on the way
        if os.path.isfile(store.root):
            raise NothingThereError(f"{store.root} is a file, not a checkpoint or a directory of checkpoints")
        raise NothingThereError(f"nothing at {store.url}: no such directory or prefix; check the path")
    rows: list[dict] = []
    for rel, dirs, files in store.walk():
        dirs.sort()
        rows.extend(_linked_checkpoints(store, rel, dirs, long))
        if not rel:
            continue
        row = _dir_row(store, rel, files, dirs, long)
        if row is not None:
            rows.append(row)
            dirs[:] = []  # a checkpoint's own arrays are no checkpoints
    return sorted(rows, key=lambda r: r["url"])


def _list_remote(store: Store, long: bool) -> list[dict]:
    keys = store.list()
    if not keys:
        store.check_root()  # a missing bucket or an unreachable server
        if getattr(store, "prefix", None) != "":  # an existing, empty bucket lists nothing, as an empty directory
            raise NothingThereError(f"nothing at {store.url}: no such directory or prefix; check the path")
    keyset = set(keys)
    subdirs: dict[str, set[str]] = {}
    partial: set[str] = set()  # prefixes holding ranks' objects (ranks/<r>.json two levels down, a chunk three)
    for k in keys:
        parts = k.split("/")
        for i in range(1, len(parts)):
            subdirs.setdefault("/".join(parts[:i]), set()).add(parts[i])
        for depth in (2, 3):
            if len(parts) > depth and mf.is_rank_object("/".join(parts[-depth:])):
                partial.add("/".join(parts[:-depth]))
    rows: list[dict] = []
    taken: set[str] = set()

    def inside_taken(k: str, inclusive: bool) -> bool:
        parts = k.split("/")
        return any("/".join(parts[:i]) in taken for i in range(1, len(parts) + (1 if inclusive else 0)))

    for k in sorted(k[: -len(mf.ROOT_META_KEY) - 1] for k in keys if k.endswith("/" + mf.ROOT_META_KEY)):
        if inside_taken(k, inclusive=False):
            continue  # inside a checkpoint
        row = _checkpoint_row(store, k, f"{k}/{mf.COMMIT_KEY}" in keyset,
                              bool(subdirs.get(k, set()) & {"meta", "ranks"}), long)
        if row is not None:
            rows.append(row)
            taken.add(k)
    for k in sorted(k[: -len(mf.COMMIT_KEY) - 1] for k in keys if k.endswith("/" + mf.COMMIT_KEY)):
        if f"{k}/{mf.ROOT_META_KEY}" not in keyset and not inside_taken(k, inclusive=True):
            rows.append(missing_root_doc(store, k))
            taken.add(k)
    # ranks' objects with neither a root document nor a marker beside them: a save stopped before
    # rank 0 wrote zarr.json
    for k in sorted(partial):
        if (f"{k}/{mf.ROOT_META_KEY}" not in keyset and f"{k}/{mf.COMMIT_KEY}" not in keyset
                and not inside_taken(k, inclusive=True)):
            rows.append(before_root_doc(store, k))
    return sorted(rows, key=lambda r: r["url"])


def _checkpoint_row(store: Store, key: str, committed: bool, ragckpt_like: bool, long: bool) -> dict | None:
    """The row for the directory/prefix `key` holding a zarr.json: a ragckpt checkpoint (committed,
    incomplete, or damaged: a zarr.json that is no ragckpt manifest beside a commit marker or
    ragckpt's own `meta/`/`ranks/`), None for anything else (a plain zarr group or array). One small
    read: the zarr.json. A store that fails to answer for it (an outage, no permission) gives an
    `unreadable` row: that says nothing about the checkpoint, and the others are still listed."""
    try:
        return _checkpoint_row_read(store, key, committed, ragckpt_like, long)
    except StorageError as e:
        row = {"url": store.child(key), "committed": committed, "unreadable": str(e)}
        if isinstance(e, AccessDeniedError) or isinstance(e.__cause__, PermissionError):
            row["denied"] = True  # waiting will not help: say so
        return row


def _checkpoint_row_read(store: Store, key: str, committed: bool, ragckpt_like: bool, long: bool) -> dict | None:
    row: dict = {"url": store.child(key), "committed": committed}
    marker_problem = store.object_problem(f"{key}/{mf.COMMIT_KEY}") if committed else None
    if marker_problem is not None:  # there but no marker: damaged, never "incomplete"
        return {**row, "committed": False,
                "damaged": f"{mf.COMMIT_KEY} is {marker_problem}, not a regular file: the commit marker is damaged"}
    if committed:  # a marker that is no marker (cut short, overwritten) is no commit: readers refuse it
        try:
            mf.parse_marker(store.read(f"{key}/{mf.COMMIT_KEY}"))
        except (ValueError, BadObjectError):  # a store that fails to answer is an error, not damage
            return {**row, "committed": False,
                    "damaged": f"{mf.COMMIT_KEY} is corrupt: the checkpoint cannot be trusted"}
    try:
        raw = store.read(f"{key}/{mf.ROOT_META_KEY}")
    except BadObjectError as e:  # a broken link, a link loop, a pipe: this one is damaged, the others still listed
        return {**row, "committed": False, "damaged": f"{mf.ROOT_META_KEY} cannot be read ({e})"}
    kind = mf.root_doc_kind(raw)
    if kind != "manifest":
        if not (committed or ragckpt_like):
            return None  # not ours: a plain zarr group or array
        why = {"invalid": "not valid JSON", "array": "the document of an array, not a checkpoint manifest"}
        return {**row, "committed": False,
                "damaged": f"{mf.ROOT_META_KEY} is {why.get(kind, 'not a ragckpt manifest')}"}
    try:
        m = mf.manifest_from_root_doc(raw, row["url"])
    except FormatError as e:
        return {**row, "committed": False, "damaged": str(e).removeprefix(row["url"] + "/")}
    if long:
        row.update(world_size=m["world_size"], layout=m["layout"],
                   tensors=sum(len(b.get("tensors") or ()) for b in m["buffers"]),
                   created=(m.get("created") or {}).get("time"), bytes=_stored_bytes(m),
                   step=_user_step(m))
    return row


def _stored_bytes(m: dict) -> int | None:
    """Bytes of every rank's buffers (padding included) where the manifest alone says so: flat
    layouts record their per-rank size; per-tensor layouts keep theirs in unit tables, which a
    listing does not read (None)."""
    total = 0
    for b in m["buffers"]:
        lay = m["layouts"][b["layout"]]
        if lay.get("family") != "flat" or not isinstance(lay.get("shard_size"), int):
            return None
        total += lay["shard_size"] * m["world_size"] * itemsize(b["dtype"])
    return total


def _user_step(m: dict) -> int | None:
    user = m.get("user")
    step = user.get("step") if isinstance(user, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def _dir_row(store: LocalStore, rel: str, files: list[str], dirs: list[str], long: bool) -> dict | None:
    """The row for local directory `rel`, which holds `files` and subdirectories `dirs`: a
    checkpoint (committed, incomplete or damaged) or the ranks' objects of a save stopped before rank
    0 wrote its root document; None for anything else (a plain zarr group included), which the
    listing then looks inside."""
    if mf.ROOT_META_KEY not in files:
        if mf.COMMIT_KEY in files:
            return missing_root_doc(store, rel)
        if {"ranks", "buffers"} & set(dirs) and mf.holds_rank_objects(store, rel):
            return before_root_doc(store, rel)
        return None
    # a directory in the marker's place lists among `dirs`: it is still a (damaged) marker
    has_marker = mf.COMMIT_KEY in files or mf.COMMIT_KEY in dirs
    return _checkpoint_row(store, rel, has_marker, bool(set(dirs) & {"meta", "ranks"}), long)


def _linked_checkpoints(store: LocalStore, rel: str, dirs: list[str], long: bool) -> list[dict]:
    """Rows for the symlinks among `dirs` that lead to a checkpoint (`latest -> step_1000`): the walk
    does not follow links (no loops), and a directory holding only such a link listed as empty.
    Only the link's own top level is looked at."""
    rows = []
    for d in dirs:
        full = os.path.join(store.root, rel, d)
        if not (os.path.islink(full) and os.path.isdir(full)):
            continue
        try:
            with os.scandir(full) as it:
                entries = [(e.name, e.is_dir()) for e in it]
        except OSError:
            continue
        row = _dir_row(store, f"{rel}/{d}" if rel else d, [n for n, is_dir in entries if not is_dir],
                       [n for n, is_dir in entries if is_dir], long)
        if row is not None:
            rows.append(row)
    return rows


def before_root_doc(store: Store, key: str) -> dict:
    """Ranks' objects without the root document rank 0 writes first: a save stopped early (or still
    running), listed as incomplete like any uncommitted checkpoint."""
    return {"url": store.child(key) if key else store.url, "committed": False,
            "incomplete": f"a save stopped before rank 0 wrote {mf.ROOT_META_KEY}, or still running; re-run it"}


def missing_root_doc(store: Store, key: str) -> dict:
    """A commit marker with no root document beside it: a checkpoint that lost its zarr.json."""
    return {"url": store.child(key), "committed": False,
            "damaged": f"{mf.ROOT_META_KEY} is missing beside {mf.COMMIT_KEY}; restore it or re-save the checkpoint"}


def save_claim(url: str, *, storage_options: dict | None = None) -> dict | None:
    """The claim an unfinished save holds on `url` (its `save_id` and who made it: pid, host, start
    time), None when there is none. A job that restarts and reaches a step again needs it to tell its
    own earlier, dead save (which keeps every other save out) from another job's."""
    return read_claim(open_store(url, storage_options))


def remove_checkpoint(url: str, *, storage_options: dict | None = None) -> None:
    """Delete the checkpoint at `url`, commit marker first: a deletion cut short leaves an
    uncommitted remainder that readers refuse and listings call incomplete, never a committed
    checkpoint with objects missing."""
    store = open_store(url, storage_options)
    keys = store.list()
    if keys:
        store.delete_all(first=[mf.COMMIT_KEY], last=[mf.ROOT_META_KEY])
    # an unfinished save's claim beside it would keep every later save out of the place (a committed
    # checkpoint's went at its commit)
    if read_claim(store) is not None:
        release_claim(store)
    if not keys:
        return
    if isinstance(store, LocalStore):
        try:
            os.rmdir(store.root)
        except OSError:  # something that is not ours was left inside: keep it and the directory
            pass


__all__ = ["NothingThereError", "list_checkpoints", "list_store", "latest_committed", "remove_checkpoint", "save_claim", "step_of"]

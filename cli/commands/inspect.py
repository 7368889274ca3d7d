"""`ragckpt info`, `ragckpt verify`, `ragckpt ls`, `ragckpt diff`: look at checkpoints without changing them."""

from __future__ import annotations

import calendar
import sys
import time
from collections import Counter

import click

import ragckpt
from cli.common import (
    emit_json,
    handle_errors,
    human_bytes,
    json_option,
    memory_option,
    nonempty_url,
    one_line,
    progress_bar,
    size_callback,
    storage_option,
)
from ragckpt.checkpoint import catalog
from ragckpt.checkpoint import manifest as mf
from ragckpt.checkpoint.compare import compare
from ragckpt.errors import BadObjectError, IntegrityError, StorageError
from ragckpt.storage.destination import annotate_set_asides
from ragckpt.storage.store import Store, open_store


def checkpoint_summary(ck: ragckpt.Checkpoint) -> dict:
    lay = ck.layout
    dtypes: Counter[str] = Counter()
    for b in lay.buffers:
        dtypes[b.dtype] += len(b.tensors)
    padding = sum(lay.layout_of(i).padding() * mf.storage_dtype(b.dtype).itemsize for i, b in enumerate(lay.buffers))
    total = lay.total_bytes()
    return {
        "url": ck.url,
        "committed": ck.committed,
        "format_version": ck.manifest.get("format_version"),
        "world_size": ck.world_size,
        "layout": ck.kind,
        "tensors": len(ck.names()),
        "buffers": [{"name": b.name, "dtype": b.dtype, "tensors": len(b.tensors)} for b in lay.buffers],
        "dtypes": dict(dtypes),
        "bytes": total,
        "data_bytes": lay.data_bytes(),
        "padding_bytes": padding,
        "padding_ratio": padding / total if total else 0.0,
        "created": ck.created,
        "user": ck.user,
    }


#: widest value `info` prints of user metadata; --json has everything
_USER_VALUE_CHARS = 80


def _short(value: object, width: int = _USER_VALUE_CHARS) -> str:
    """A value as one short line: containers say how many entries they hold rather than list
    thousands of them (an imported DCP checkpoint carries every hyperparameter's pickled bytes)."""
    if isinstance(value, dict):
        text = "{" + ", ".join(f"{k}: {_short(v, 24)}" for k, v in value.items()) + "}"
        if len(text) > width:
            names = ", ".join(map(str, list(value)[:4])) + (", ..." if len(value) > 4 else "")
            text = f"{{{len(value)} entries: {names}}}"
            if len(text) > width:
                text = f"{{{len(value)} entries}}"
    elif isinstance(value, (list, tuple)) and len(repr(value)) > width:
        text = f"[{len(value)} items]"
    else:
        text = repr(value)
    return mf.shorten(text, width)


def user_lines(user: dict) -> list[str]:
    """One line per top-level key of the user metadata (`ragckpt info --json` gives it whole)."""
    return [f"{k}: {_short(v)}" for k, v in user.items()]


@click.command()
@click.argument("url", callback=nonempty_url)
@storage_option
@json_option
@handle_errors
def info(url: str, storage_options: dict, as_json: bool) -> None:
    """Summarise a checkpoint: world size, layout, tensors, bytes, dtypes, padding, commit state.

    \b
    Example:
      ragckpt info /ckpt/step_1000
      ragckpt info s3://bucket/run/step_1000 --json
    """
    ck = ragckpt.open(url, storage_options=storage_options, allow_uncommitted=True)
    s = checkpoint_summary(ck)
    if as_json:
        emit_json(s)
        return
    state = "committed" if s["committed"] else "NOT COMMITTED (incomplete: the save was interrupted or is running)"
    click.echo(f"checkpoint   {s['url']}")
    click.echo(f"state        {state}")
    click.echo(f"format       ragckpt v{s['format_version']}")
    click.echo(f"world size   {s['world_size']}")
    click.echo(f"layout       {s['layout']}")
    click.echo(f"tensors      {s['tensors']} in {len(s['buffers'])} buffer(s)")
    click.echo(f"dtypes       {', '.join(f'{k} x{v}' for k, v in sorted(s['dtypes'].items()))}")
    click.echo(f"bytes        {human_bytes(s['bytes'])} stored, {human_bytes(s['data_bytes'])} tensor data")
    click.echo(f"padding      {human_bytes(s['padding_bytes'])} ({100 * s['padding_ratio']:.2f}%)")
    for i, line in enumerate(user_lines(s["user"])):
        click.echo(f"{'user' if i == 0 else '':<13}{line}")
    click.echo(f"created      {s['created'].get('time', '?')} on {s['created'].get('host', '?')}")


@click.command()
@click.argument("url", callback=nonempty_url)
@click.option("--workers", type=click.IntRange(min=1), default=None, help="Objects checked in parallel.")
@memory_option
@storage_option
@json_option
@handle_errors
def verify(url: str, workers: int | None, memory: int, storage_options: dict, as_json: bool) -> None:
    """Check every stored object against its checksum; names each bad object and exits 1.

    \b
    Example:
      ragckpt verify /ckpt/step_1000
    """
    try:
        ck = ragckpt.open(url, storage_options=storage_options)
    except (IntegrityError, BadObjectError) as e:
        # a metadata object missing, cut short or failing its checksum, or a corrupt marker: damage,
        # judged like a data object's (exit 1), not the "could not tell" of an outage (exit 2)
        url = open_store(url, storage_options).url  # as `ck.url` would name it
        if as_json:
            emit_json({"url": url, "ok": False, "objects": 0, "bytes": 0, "problems": [str(e)]})
        else:
            click.echo(f"BAD  {e}", err=True)
            click.echo(f"FAILED (1 problem(s)): the metadata of {url} cannot be trusted; restore the object named "
                       "above from a copy, or re-save the checkpoint")
        sys.exit(1)
    with progress_bar(ck.verify_bytes(), "verifying", not as_json) as advance:
        rep = ck.verify(workers=workers, progress=advance, memory_bytes=memory)
    if as_json:
        emit_json({"url": ck.url, "ok": rep.ok, "objects": rep.objects, "bytes": rep.bytes, "problems": rep.problems})
    else:
        for p in rep.problems:
            click.echo(f"BAD  {p}", err=True)
        verdict = "OK" if rep.ok else f"FAILED ({len(rep.problems)} problem(s))"
        advice = "" if rep.ok else "; restore the objects named above from a copy, or re-save the checkpoint"
        click.echo(f"{verdict}: {rep.objects} objects, {human_bytes(rep.bytes)} checked in {ck.url}{advice}")
    if not rep.ok:
        sys.exit(1)


def _holds_rank_objects(store: Store) -> bool:
    """`manifest.holds_rank_objects` of URL itself, False where the store cannot be listed: the
    listing of URL that follows then says why in the user's words (a missing bucket named as such,
    not as a failure to list `URL/ranks`)."""
    try:
        return mf.holds_rank_objects(store)
    except StorageError:
        return False


@click.command(name="ls")
@click.argument("url", callback=nonempty_url)
@click.option("--long", "-l", "long_", is_flag=True,
              help="For a checkpoint: shape, dtype and size of every tensor (--json always gives these and each tensor's buffer and dims). For a "
                   "directory: world size, layout, tensor count and creation time of every checkpoint; a directory of "
                   "step-<n> checkpoints (a training job's) is always listed as a table of step, world size, size, "
                   "state and age.")
@storage_option
@json_option
@handle_errors
def ls(url: str, long_: bool, storage_options: dict, as_json: bool) -> None:
    """List the tensors of a checkpoint, or the checkpoints under a directory/prefix.

    \b
    Examples:
      ragckpt ls /ckpt/step_1000 -l
      ragckpt ls s3://bucket/run7 -l
      ragckpt ls /ckpt/run7            # step-<n> checkpoints: step, world, size, state, age
    """
    store = open_store(url, storage_options)
    # a commit marker makes URL a checkpoint even without its zarr.json: ragckpt.open then says what is wrong
    if store.exists(mf.COMMIT_KEY) or (store.exists(mf.ROOT_META_KEY) and _is_ragckpt_root(store)):
        ck = ragckpt.open(url, storage_options=storage_options, allow_uncommitted=True)
        rows = []
        for n in ck.names():
            m = ck.meta(n)
            rows.append({"name": n, "shape": list(m.shape), "dtype": m.dtype, "bytes": m.nbytes,
                         "buffer": m.buffer, "dims": m.sharded_dims})
        if as_json:
            emit_json(rows)
            return
        for r in rows:
            click.echo(f"{r['name']:<60} {str(tuple(r['shape'])):<20} {r['dtype']:<14} {human_bytes(r['bytes'])}"
                       if long_ else r["name"])
        return
    # URL itself holds ranks' objects but no root document yet: its own row, as its parent lists it
    # always with the long fields: they come from the zarr.json each row reads anyway, and a training
    # job's root (step-<n> checkpoints) is shown with them; other short listings drop them again
    rows = [catalog.before_root_doc(store, "")] if _holds_rank_objects(store) else catalog.list_store(store, True)
    steps = any(catalog.step_of(r["url"]) is not None for r in rows)
    if not (steps or long_):
        rows = [{k: v for k, v in r.items() if k not in _LONG_KEYS} for r in rows]
    rows = annotate_set_asides(rows, storage_options)  # an interrupted --overwrite's copies: what to run
    for r in rows if steps or long_ else ():  # the short form's rows stay {url, committed}
        r["state"] = _state(r)
        r["age_s"] = _age_s(r.get("created"))
    if steps:  # step-9 before step-10
        rows.sort(key=lambda r: (catalog.step_of(r["url"]) is None, catalog.step_of(r["url"]) or 0, r["url"]))
    if as_json:
        emit_json(rows)
    elif not rows:  # an empty listing said nothing: was the path right, did the save go elsewhere?
        click.echo(f"no checkpoints under {store.url} (nothing with a ragckpt zarr.json or {mf.COMMIT_KEY} in it)",
                   err=True)
    elif steps:
        _echo_step_table(rows)
    else:
        for r in rows:
            state = ("UNREADABLE " if "unreadable" in r else "DAMAGED    " if "damaged" in r
                     else "committed  " if r["committed"] else "INCOMPLETE ")
            line = f"{state} {r['url']}"
            if "unreadable" in r or "damaged" in r or "incomplete" in r:
                line += f"  ({r.get('unreadable') or r.get('damaged') or r['incomplete']})"
            elif long_:
                line += (f"  world {r['world_size']}, {r['layout']}, {r['tensors']} tensors, "
                         f"created {r['created'] or '?'}")
            line += f"  [{r['set_aside']}]" if "set_aside" in r else ""
            click.echo(one_line(line))
    unreadable = [r for r in rows if "unreadable" in r]
    if unreadable:  # after the listing (with --json, one document: the rows say which)
        advice = ("check their permissions or credentials, or run as a user that may read them"
                  if all(r.get("denied") for r in unreadable)
                  else "the store failed, not necessarily the checkpoint: try again later")
        click.echo(f"error: {len(unreadable)} checkpoint(s) could not be read ({one_line(unreadable[0]['unreadable'])}); "
                   f"{advice}", err=True)
        sys.exit(2)


#: what `catalog.list_store(..., long=True)` adds to a row
_LONG_KEYS = frozenset({"world_size", "layout", "tensors", "created", "bytes", "step"})


def _state(row: dict) -> str:
    """One word for a listing row, as `ragckpt.latest_committed` judges it."""
    if "unreadable" in row:
        return "unreadable"
    if "damaged" in row:
        return "damaged"
    return "committed" if row["committed"] else "incomplete"


def _age_s(created: object) -> int | None:
    """Seconds since the manifest's creation time (when the save began), None where unknown or unparsable."""
    if not isinstance(created, str):
        return None
    try:
        t = calendar.timegm(time.strptime(created, "%Y-%m-%dT%H:%M:%SZ"))
    except ValueError:
        return None
    return max(0, int(time.time() - t))


def _human_age(seconds: int | None) -> str:
    if seconds is None:
        return "-"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def _echo_step_table(rows: list[dict]) -> None:
    """The listing of a root holding `step-<n>` checkpoints (a checkpointer's): what to resume from
    and what each costs, one row per checkpoint, newest last."""
    table = [("STEP", "WORLD", "SIZE", "STATE", "AGE", "URL")]
    for r in rows:
        step = r.get("step") if isinstance(r.get("step"), int) else catalog.step_of(r["url"])
        size = r.get("bytes")
        table.append(("-" if step is None else str(step),
                      str(r["world_size"]) if isinstance(r.get("world_size"), int) else "-",
                      human_bytes(size) if isinstance(size, int) else "-",
                      r["state"], _human_age(r.get("age_s")), r["url"]))
    widths = [max(len(row[i]) for row in table) for i in range(5)]
    for row, r in zip(table, [None, *rows], strict=True):
        line = "  ".join(cell.ljust(widths[i]) if i < 5 else cell for i, cell in enumerate(row))
        why = r and (r.get("unreadable") or r.get("damaged") or r.get("incomplete"))
        line += f"  ({why})" if why else ""
        line += f"  [{r['set_aside']}]" if r and "set_aside" in r else ""
        click.echo(one_line(line))


def _is_ragckpt_root(store: Store) -> bool:
    """The root is a checkpoint, for `ls` to list its tensors (or for `ragckpt.open` to say what is
    wrong with it): a commit marker, a ragckpt manifest, or a damaged zarr.json beside ragckpt's own
    `meta/` or `ranks/`. False for a plain zarr group or array, whose subdirectories `ls` lists."""
    if store.exists(mf.COMMIT_KEY):
        return True
    kind = mf.root_doc_kind(store.read(mf.ROOT_META_KEY))
    return kind == "manifest" or bool(store.list("ranks") or store.list("meta"))


@click.command(name="diff")
@click.argument("a", callback=nonempty_url)
@click.argument("b", callback=nonempty_url)
@click.option("--name", "names", multiple=True, metavar="GLOB",
              help="Compare only tensors whose name matches (repeatable), e.g. --name 'model.*'.")
@click.option("--window", default="256MiB", callback=size_callback, show_default=True,
              help="Memory for data in flight, both checkpoints and all threads together (at least 4.25MiB for "
                   "checkpoints with the default 1 MiB checksum blocks).")
@click.option("--workers", type=click.IntRange(min=1), default=None, help="Windows compared in parallel.")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
@storage_option
@json_option
@handle_errors
def diff(a: str, b: str, names: tuple[str, ...], window: int, workers: int | None, no_progress: bool,
         storage_options: dict, as_json: bool) -> None:
    """Compare two checkpoints tensor by tensor, bit for bit; exits 1 if any tensor differs.

    The two may have any world sizes and layouts (a checkpoint and its reshard, an import and its
    source's re-import): tensors are matched by name. Lists tensors found on one side only, shape
    and dtype mismatches, and for each tensor whose values differ how many elements, the first one
    and the largest difference. User metadata and per-rank extras are not compared.

    \b
    Examples:
      ragckpt diff /ckpt/step_1000 /ckpt/step_1000_w4096
      ragckpt diff /ckpt/a s3://bucket/run/a --name 'model.*' --json
    """
    with progress_bar(None, "comparing", not (as_json or no_progress)) as bar:
        rep = compare(a, b, names=names or None, storage_options=storage_options, window_bytes=window,
                      workers=workers, progress=bar, on_total=bar.set_total)
    if as_json:
        emit_json(rep.as_dict())
    else:
        for d in rep.differences:
            label = {"only_a": "ONLY A", "only_b": "ONLY B"}.get(d.kind, d.kind.upper())
            click.echo(f"{label:<7} {d.name}: {d.detail}")
        verdict = "identical" if rep.ok else f"DIFFERENT: {len(rep.differences)} tensor(s) differ"
        click.echo(f"{verdict}; {rep.identical} of {rep.compared} tensors compared element by element are "
                   f"identical ({human_bytes(rep.bytes)} each side)")
    if not rep.ok:
        sys.exit(1)


commands = [info, verify, ls, diff]

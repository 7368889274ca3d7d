"""`ragckpt info`, `ragckpt verify`, `ragckpt ls`: look at checkpoints without changing them."""

from __future__ import annotations

import os
import sys
from collections import Counter

import click

import ragckpt
from cli.common import emit_json, fail, handle_errors, human_bytes, json_option, progress_bar, storage_option
from ragckpt.checkpoint import manifest as mf
from ragckpt.storage.store import open_store


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


@click.command()
@click.argument("url")
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
    if s["user"]:
        click.echo(f"user         {s['user']}")
    click.echo(f"created      {s['created'].get('time', '?')} on {s['created'].get('host', '?')}")


@click.command()
@click.argument("url")
@click.option("--workers", type=click.IntRange(min=1), default=None, help="Objects checked in parallel.")
@storage_option
@json_option
@handle_errors
def verify(url: str, workers: int | None, storage_options: dict, as_json: bool) -> None:
    """Check every stored object against its checksum; names each bad object and exits 1.

    \b
    Example:
      ragckpt verify /ckpt/step_1000
    """
    ck = ragckpt.open(url, storage_options=storage_options)
    with progress_bar(ck.layout.total_bytes(), "verifying", not as_json) as advance:
        rep = ck.verify(workers=workers, progress=advance)
    if as_json:
        emit_json({"url": ck.url, "ok": rep.ok, "objects": rep.objects, "bytes": rep.bytes, "problems": rep.problems})
    else:
        for p in rep.problems:
            click.echo(f"BAD  {p}", err=True)
        verdict = "OK" if rep.ok else f"FAILED ({len(rep.problems)} problem(s))"
        click.echo(f"{verdict}: {rep.objects} objects, {human_bytes(rep.bytes)} checked in {ck.url}")
    if not rep.ok:
        sys.exit(1)


@click.command(name="ls")
@click.argument("url")
@click.option("--long", "-l", "long_", is_flag=True, help="Show shape, dtype and size of every tensor (--json adds buffer and dims).")
@storage_option
@json_option
@handle_errors
def ls(url: str, long_: bool, storage_options: dict, as_json: bool) -> None:
    """List the tensors of a checkpoint, or the checkpoints under a directory/prefix.

    \b
    Examples:
      ragckpt ls /ckpt/step_1000 -l
      ragckpt ls s3://bucket/run7
    """
    store = open_store(url, storage_options)
    if store.exists(mf.ROOT_META_KEY):
        ck = ragckpt.open(url, storage_options=storage_options, allow_uncommitted=True)
        rows = []
        for n in ck.names():
            m = ck.meta(n)
            rows.append({"name": n, "shape": list(m.shape), "dtype": m.dtype, "bytes": m.nbytes,
                         "buffer": m.buffer, "dims": len(m.placement.dims)})
        if as_json:
            emit_json(rows)
            return
        for r in rows:
            click.echo(f"{r['name']:<60} {str(tuple(r['shape'])):<20} {r['dtype']:<14} {human_bytes(r['bytes'])}"
                       if long_ else r["name"])
        return
    keys = store.list()
    if not keys:  # an empty directory lists nothing; a typo must not look like one
        store.check_root()
        root = getattr(store, "root", None)
        if root is not None and os.path.isfile(root):
            fail(f"{root} is a file, not a checkpoint or a directory of checkpoints")
        if root is None or not os.path.isdir(root):
            fail(f"nothing at {store.url}: no such directory or prefix; check the path")
    found = sorted({k.rsplit("/", 1)[0] for k in keys if k.endswith("/" + mf.ROOT_META_KEY)
                    and k.count("/") >= 1 and not k.split("/", 1)[1].startswith("buffers")})
    roots = [k for k in found if store.exists(f"{k}/{mf.ROOT_META_KEY}") and "/buffers/" not in f"/{k}/"
             and "/meta/" not in f"/{k}/"]
    rows = [{"url": store.child(k), "committed": store.exists(f"{k}/{mf.COMMIT_KEY}")} for k in roots]
    if as_json:
        emit_json(rows)
        return
    for r in rows:
        click.echo(f"{'committed  ' if r['committed'] else 'INCOMPLETE '} {r['url']}")


commands = [info, verify, ls]

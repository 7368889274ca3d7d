"""`ragckpt recover`: finish or undo an --overwrite of a destination that was killed outright."""

from __future__ import annotations

import click

from cli.common import emit_json, handle_errors, json_option, nonempty_url, storage_option
from ragckpt.storage.destination import recover as recover_destination


@click.command()
@click.argument("dst", callback=nonempty_url)
@storage_option
@json_option
@handle_errors
def recover(dst: str, storage_options: dict, as_json: bool) -> None:
    """Finish or undo every --overwrite of DST that was killed outright (SIGKILL, a lost node).

    An overwrite sets DST's old contents aside (DST.replaced-<id>) until the new checkpoint is
    committed. Killed before that commit, the old checkpoint is moved back into DST (DST's
    uncommitted new output is removed first); killed after it, the set-aside copy is deleted (it was
    being discarded). Every later reshard or import into DST does the same first; this command does
    it alone. Refused while another job is overwriting DST. Exits 0, also when there was nothing to do.

    \b
    Examples:
      ragckpt recover /ckpt/step_1000
      ragckpt recover s3://bucket/run7/step_1000 --json
    """
    done = recover_destination(dst, storage_options)
    if as_json:
        emit_json({"dst": dst, "recovered": done})
        return
    if not done:
        click.echo(f"{dst}: no interrupted --overwrite to finish")
    for r in done:
        click.echo(f"{r['action']:<9} {r['set_aside']}  ({r['reason']})")


commands = [recover]

"""`ragckpt reshard`: rewrite a checkpoint for another world size and/or layout kind."""

from __future__ import annotations

import click

from cli.common import (
    MAX_WORLD_SIZE,
    emit_json,
    granularity_callback,
    handle_errors,
    human_bytes,
    human_rate,
    json_option,
    nonempty_url,
    progress_bar,
    size_callback,
    storage_option,
)
from ragckpt.planner.state import PLANNED_KINDS
from ragckpt.reshard import distributed as distributed_job
from ragckpt.reshard import offline


@click.command()
@click.argument("src", callback=nonempty_url)
@click.argument("dst")
@click.option("--to", "to", type=click.IntRange(1, MAX_WORLD_SIZE), default=None,
              help=f"Destination world size (at most {MAX_WORLD_SIZE:,}); required.")
@click.option("--world-size", "-w", "world_size", type=click.IntRange(1, MAX_WORLD_SIZE), default=None,
              help="The same as --to, as the importers name it.")
@click.option("--from", "from_", type=click.IntRange(1, MAX_WORLD_SIZE), default=None,
              help="Expected source world size (checked against SRC's metadata).")
@click.option("--layout", type=click.Choice(PLANNED_KINDS), default=None,
              help="Destination layout kind: ragged (re-planned), row (FSDP2 torch.chunk rows), element (flat "
                   "equal partitions). Default: SRC's kind.")
@click.option("--granularity", default=None, callback=granularity_callback, metavar="POLICY",
              help="Planner granularity for --layout ragged: row, element, whole, rows:K or an element count. "
                   "Default: inferred from a ragged SRC, else row.")
@click.option("--align", type=click.IntRange(min=1), default=1, help="Shard-size alignment in elements.")
@click.option("--workers", type=click.IntRange(min=1), default=None,
              help="Processes on this machine, each writing a disjoint share of destination ranks. Default: one "
                   "per 4096 destination objects (ranks x (buffers + 1)), at most one per usable CPU.")
@click.option("--threads", type=click.IntRange(min=1), default=None, help="Writer threads per process (default 4).")
@click.option("--window", default="512MiB", callback=size_callback, show_default=True,
              help="Memory budget for data in flight, all processes together (e.g. 256MiB, 2GiB).")
@click.option("--overwrite", is_flag=True, help="Replace what the DST directory or prefix holds (a checkpoint or anything else; a file at DST is refused). The old contents are set aside until the new checkpoint is committed and put back if the run fails (see docs/RESHARD.md).")
@click.option("--distributed", is_flag=True,
              help="Run as one process of a torchrun job (RANK/WORLD_SIZE from the environment, gloo); "
                   "--window is then per process.")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
@storage_option
@json_option
@handle_errors
def reshard(src: str, dst: str, to: int | None, world_size: int | None, from_: int | None, layout: str | None, granularity: str | int | None,
            align: int, workers: int, threads: int | None, window: int, overwrite: bool, distributed: bool,
            no_progress: bool, storage_options: dict, as_json: bool) -> None:
    """Reshard checkpoint SRC into a new committed checkpoint DST for --to N ranks.

    Any layout kind converts to any other; optimizer state moves with its parameters. Streaming with
    bounded memory (--window); every source range read is checksum-verified; DST is committed only
    when every rank is written. An interrupted run leaves DST uncommitted and re-running the same
    command redoes it.

    \b
    Examples:
      ragckpt reshard /ckpt/step_1000 /ckpt/step_1000_w4096 --from 8192 --to 4096 --workers 2
      ragckpt reshard s3://b/run/step_9 /local/step_9_row --to 64 --layout row -o anon=false --json
      torchrun --nproc-per-node 8 $(which ragckpt) reshard --distributed SRC DST --to 4096
    """
    to = _destination_world_size(to, world_size)
    if distributed and workers is not None:
        raise click.UsageError("--workers does not apply with --distributed: the job's processes are torchrun's "
                               "(--nproc-per-node, --nnodes)")
    kwargs = dict(from_world_size=from_, layout=layout, granularity=granularity, align=align, threads=threads,
                  window=window, overwrite=overwrite, storage_options=storage_options)
    with progress_bar(None, "resharding", not (as_json or no_progress)) as bar:
        set_total, advance = bar.set_total, bar
        if distributed:
            stats = distributed_job.run(src, dst, to, progress=advance, **kwargs)  # type: ignore[arg-type]
            if stats is None:
                return
        else:
            stats = offline.reshard(src, dst, to, workers=workers, progress=advance, on_total=set_total,
                               **kwargs)  # type: ignore[arg-type]
    if as_json:
        emit_json(stats.as_dict())
        return
    peak = max(stats.peak_rss_bytes, stats.peak_rss_workers_bytes)
    click.echo(f"resharded {stats.src} ({stats.from_world_size} ranks, {stats.from_layout}) -> {stats.dst} "
               f"({stats.to_world_size} ranks, {stats.to_layout})")
    click.echo(f"{stats.tensors} tensors, {human_bytes(stats.bytes_written)} written, {human_bytes(stats.bytes_read)} "
               f"read in {stats.seconds:.2f}s ({human_rate(stats.gb_per_s * 1e9, 1.0)}) with {stats.processes} process(es) x "
               f"{stats.threads} thread(s); peak RSS {human_bytes(peak)}")
    for line in stats.notes():
        click.echo(line)


def _destination_world_size(to: int | None, world_size: int | None) -> int:
    """--to, or --world-size as the importers call it; both must agree when both are given (one
    name for the option silently took whichever came last)."""
    if to is None and world_size is None:
        raise click.UsageError("Missing option '--to' (or its alias '--world-size'): the destination world size")
    if to is not None and world_size is not None and to != world_size:
        raise click.UsageError(f"--to {to} and --world-size {world_size} disagree; they name the same destination "
                               "world size, give one of them")
    return to if to is not None else world_size  # type: ignore[return-value]


commands = [reshard]

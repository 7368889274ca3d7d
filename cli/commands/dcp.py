"""`ragckpt import-dcp` and `ragckpt export-dcp`: PyTorch Distributed Checkpoint conversion."""

from __future__ import annotations

import math

import click

from cli.common import (
    MAX_WORLD_SIZE,
    emit_json,
    handle_errors,
    human_bytes,
    json_option,
    memory_option,
    new_layout_options,
    nonempty_url,
    progress_bar,
    storage_option,
)
from ragckpt.convert import DEFAULT_EXPORT_CHUNK_BYTES
from ragckpt.convert.dcp import export_dcp, import_dcp

MIN_CHUNK_BYTES = 1 << 10  # below this a chunk is mostly torch.save framing, and dcp.load crawls


def chunk_mib_callback(ctx: click.Context, param: click.Parameter, value: float) -> int:
    """Click callback: `--chunk-mib` as bytes. inf/nan and sizes under 1 KiB (0, negatives, 1e-9,
    which would make 1-byte chunks) are usage errors."""
    nbytes = value * 2**20
    if not math.isfinite(nbytes) or nbytes < MIN_CHUNK_BYTES:
        raise click.BadParameter(f"{value} is not a usable chunk size; give a finite size of at least "
                                 "1/1024 MiB (1 KiB)")
    return int(nbytes)


@click.command(name="import-dcp")
@click.argument("dcp_dir", type=click.Path(file_okay=False), callback=nonempty_url)
@click.argument("dst")
@click.option("--world-size", "-w", type=click.IntRange(1, MAX_WORLD_SIZE), default=None,
              help="Ranks of the new checkpoint, at most 1,048,576 (default: the DCP save's world size).")
@new_layout_options(recorded=True)
@click.option("--model-prefix", default=None,
              help="Prefix of model weights in DCP keys, stripped from tensor names (default: guessed; 'model.' "
                   "for a {\"model\": ...} save, '' for a bare model.state_dict()).")
@memory_option
@click.option("--workers", type=click.IntRange(min=1), default=None, help="Rank buffers written in parallel.")
@click.option("--overwrite", is_flag=True, help="Replace what DST holds (a checkpoint or anything else). The old contents are set aside until the new checkpoint is committed and put back if the run fails (see docs/RESHARD.md).")
@storage_option
@json_option
@handle_errors
def import_dcp_cmd(dcp_dir: str, dst: str, world_size: int | None, layout: str | None, granularity: str | None,
                   model_prefix: str | None, memory: int, workers: int | None, overwrite: bool,
                   storage_options: dict, as_json: bool) -> None:
    """Convert a torch.distributed.checkpoint (DCP) directory into a ragckpt checkpoint.

    DCP_DIR is a local directory or a URL (s3://bucket/prefix, as torch's fsspec writer saves it);
    -o storage options apply to both DCP_DIR and DST. Streams tensor bytes from the .distcp files by
    range; no process group is needed. DCP keys model.<fqn> become <fqn>, optim.* keys are kept,
    non-tensor entries (optimizer hyperparameters) are carried in the user metadata. See
    docs/CONVERT_DCP.md.

    \b
    Examples:
      ragckpt import-dcp /ckpt/dcp/step_1000 /ckpt/rag/step_1000 --world-size 64
      ragckpt import-dcp s3://bkt/dcp/step_1000 s3://bkt/rag/step_1000 -o profile=training
    """
    with progress_bar(None, "importing", not as_json) as bar:
        on_plan, advance = bar.set_total, bar
        s = import_dcp(dcp_dir, dst, world_size=world_size, layout=layout, granularity=granularity,
                       overwrite=overwrite, memory_bytes=memory, workers=workers, storage_options=storage_options,
                       progress=advance,
                       on_plan=on_plan, model_prefix=model_prefix)
    if as_json:
        emit_json(s.to_json())
        return
    saved = s.saved_world_size if s.saved_world_size is not None else "?"
    click.echo(f"imported {s.tensors} tensors ({human_bytes(s.tensor_bytes)}) and {s.non_tensor_entries} "
               f"non-tensor entries from {s.source} (saved by {saved} ranks) into {s.destination} "
               f"for {s.world_size} ranks, layout {s.layout}")
    for note in s.notes:
        click.echo(f"note: {note}")


@click.command(name="export-dcp")
@click.argument("src", callback=nonempty_url)
@click.argument("out_dir", type=click.Path())
@click.option("--model-prefix", default=None,
              help="Prefix of model weights in DCP keys (default: what import-dcp recorded, else 'model.'; "
                   "'' for a bare model.state_dict()).")
@click.option("--chunk-mib", "max_chunk_bytes", type=float, default=DEFAULT_EXPORT_CHUNK_BYTES / 2**20,
              show_default=True, callback=chunk_mib_callback,
              help="Largest DCP chunk in MiB, at least 1/1024 (1 KiB); smaller where one chunk per worker "
                   "would not fit in --memory.")
@memory_option
@click.option("--workers", type=click.IntRange(min=1), default=None, help="Files written in parallel.")
@click.option("--overwrite", is_flag=True,
              help="Replace a non-empty OUT_DIR (swapped in atomically; replaced in place if it is a mount point).")
@storage_option
@json_option
@handle_errors
def export_dcp_cmd(src: str, out_dir: str, model_prefix: str | None, max_chunk_bytes: int, memory: int,
                   workers: int | None, overwrite: bool, storage_options: dict, as_json: bool) -> None:
    """Write a ragckpt checkpoint as a DCP directory that torch.distributed.checkpoint.load reads
    into FSDP2 (or any sharding) at any world size. OUT_DIR is a local path, absent or empty
    unless --overwrite; SRC may be any checkpoint URL.

    \b
    Example:
      ragckpt export-dcp /ckpt/rag/step_1000 /ckpt/dcp/step_1000
      # then, in every rank:  dcp.load({"model": msd, "optim": osd}, checkpoint_id="/ckpt/dcp/step_1000")
    """
    with progress_bar(None, "exporting", not as_json) as bar:
        on_plan, advance = bar.set_total, bar
        s = export_dcp(src, out_dir, overwrite=overwrite, model_prefix=model_prefix,
                       max_chunk_bytes=max_chunk_bytes, workers=workers, memory_bytes=memory,
                       storage_options=storage_options, progress=advance, on_plan=on_plan)
    if as_json:
        emit_json(s.to_json())
        return
    click.echo(f"exported {s.tensors} tensors ({human_bytes(s.tensor_bytes)}, {s.chunks} chunks in {s.files} "
               f"file(s)) and {s.non_tensor_entries} non-tensor entries from {s.source} to {s.destination}")
    for w in s.warnings:
        click.echo(f"note: {w}")


commands = [import_dcp_cmd, export_dcp_cmd]

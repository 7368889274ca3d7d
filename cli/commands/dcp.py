"""`ragckpt import-dcp` and `ragckpt export-dcp`: PyTorch Distributed Checkpoint conversion."""

from __future__ import annotations

import click

from cli.common import (
    emit_json,
    handle_errors,
    human_bytes,
    json_option,
    new_layout_options,
    progress_bar,
    storage_option,
)
from ragckpt.convert.dcp import DEFAULT_EXPORT_CHUNK_BYTES, export_dcp, import_dcp


@click.command(name="import-dcp")
@click.argument("dcp_dir", type=click.Path(file_okay=False))
@click.argument("dst")
@click.option("--world-size", "-w", type=int, default=None,
              help="Ranks of the new checkpoint (default: the DCP save's world size).")
@new_layout_options
@click.option("--workers", type=int, default=None, help="Rank buffers written in parallel.")
@click.option("--overwrite", is_flag=True, help="Replace an existing checkpoint at DST.")
@storage_option
@json_option
@handle_errors
def import_dcp_cmd(dcp_dir: str, dst: str, world_size: int | None, layout: str, granularity: str,
                   workers: int | None, overwrite: bool, storage_options: dict, as_json: bool) -> None:
    """Convert a torch.distributed.checkpoint (DCP) directory into a ragckpt checkpoint.

    Streams tensor bytes from the .distcp files by range; no process group is needed. DCP keys
    model.<fqn> become <fqn>, optim.* keys are kept, non-tensor entries (optimizer hyperparameters)
    are carried in the user metadata. See docs/CONVERT_DCP.md.

    \b
    Example:
      ragckpt import-dcp /ckpt/dcp/step_1000 /ckpt/rag/step_1000 --world-size 64
    """
    with progress_bar(None, "importing", not as_json) as bar:
        on_plan, advance = bar.set_total, bar
        s = import_dcp(dcp_dir, dst, world_size=world_size, layout=layout, granularity=granularity,
                       overwrite=overwrite, workers=workers, storage_options=storage_options, progress=advance,
                       on_plan=on_plan)
    if as_json:
        emit_json(s.to_json())
        return
    saved = s.saved_world_size if s.saved_world_size is not None else "?"
    click.echo(f"imported {s.tensors} tensors ({human_bytes(s.tensor_bytes)}) and {s.non_tensor_entries} "
               f"non-tensor entries from {s.source} (saved by {saved} ranks) into {s.destination} "
               f"for {s.world_size} ranks, layout {s.layout}")


@click.command(name="export-dcp")
@click.argument("src")
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--model-prefix", default=None,
              help="Prefix of model weights in DCP keys (default: what import-dcp recorded, else 'model.'; "
                   "'' for a bare model.state_dict()).")
@click.option("--chunk-mib", type=float, default=DEFAULT_EXPORT_CHUNK_BYTES / 2**20, show_default=True,
              help="Largest DCP chunk (and per-worker memory) in MiB.")
@click.option("--workers", type=int, default=None, help="Files written in parallel.")
@click.option("--overwrite", is_flag=True, help="Replace an existing OUT_DIR (swapped in atomically).")
@storage_option
@json_option
@handle_errors
def export_dcp_cmd(src: str, out_dir: str, model_prefix: str | None, chunk_mib: float, workers: int | None,
                   overwrite: bool, storage_options: dict, as_json: bool) -> None:
    """Write a ragckpt checkpoint as a DCP directory that torch.distributed.checkpoint.load reads
    into FSDP2 (or any sharding) at any world size.

    \b
    Example:
      ragckpt export-dcp /ckpt/rag/step_1000 /ckpt/dcp/step_1000
      # then, in every rank:  dcp.load({"model": msd, "optim": osd}, checkpoint_id="/ckpt/dcp/step_1000")
    """
    with progress_bar(None, "exporting", not as_json) as bar:
        on_plan, advance = bar.set_total, bar
        s = export_dcp(src, out_dir, overwrite=overwrite, model_prefix=model_prefix,
                       max_chunk_bytes=max(1, int(chunk_mib * 2**20)), workers=workers,
                       storage_options=storage_options, progress=advance, on_plan=on_plan)
    if as_json:
        emit_json(s.to_json())
        return
    click.echo(f"exported {s.tensors} tensors ({human_bytes(s.tensor_bytes)}, {s.chunks} chunks in {s.files} "
               f"file(s)) and {s.non_tensor_entries} non-tensor entries from {s.source} to {s.destination}")


commands = [import_dcp_cmd, export_dcp_cmd]

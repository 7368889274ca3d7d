"""`ragckpt export-hf` and `ragckpt import-hf`: bridges to Hugging Face safetensors models."""

from __future__ import annotations

import click

import ragckpt
from cli.common import (
    MAX_WORLD_SIZE,
    emit_json,
    handle_errors,
    human_bytes,
    human_rate,
    json_option,
    memory_option,
    new_layout_options,
    nonempty_url,
    progress_bar,
    size_callback,
    storage_option,
)
from ragckpt.convert.hf_export import (
    export_hf,
    load_rename_map,
    output_nbytes,
    recorded_weights,
    select_tensors,
)
from ragckpt.convert.hf_import import import_hf, open_hf_model
from ragckpt.planner.state import CheckpointLayout


@click.command(name="export-hf")
@click.argument("src", callback=nonempty_url)
@click.argument("out_dir")
@click.option("--dtype", type=click.Choice(["keep", "bf16", "fp16", "fp32"]), default="keep", show_default=True,
              help="Cast floating-point tensors (fp8 excepted) blockwise; keep = bit-exact copy.")
@click.option("--max-shard-size", default="5GB", show_default=True, callback=size_callback,
              help="Most tensor data per output file (its header adds a few KB, as with Hugging Face): 5GB, 500MB, "
                   "2GiB or bytes. Bigger models get model-0000i-of-0000N files and model.safetensors.index.json.")
@click.option("--include", "include", multiple=True, metavar="PATTERN",
              help="Export only names matching this glob (fnmatch; repeatable), e.g. 'model.layers.*'.")
@click.option("--rename-map", type=click.Path(dir_okay=False), default=None,
              help="JSON file {checkpoint_name: output_name}; unlisted names are kept.")
@click.option("--all-tensors", is_flag=True,
              help="Also export optimizer state (optim.state.*) and extra.* tensors; default is model weights only.")
@click.option("--config", "config", type=click.Path(dir_okay=False), default=None,
              help="Write this config.json with the weights (a training checkpoint records none; one from "
                   "import-hf is written back without this).")
@click.option("--overwrite", is_flag=True, help="Replace weight files (and, with --config, config.json) already in OUT_DIR.")
@memory_option
@click.option("--workers", type=click.IntRange(min=1), default=None, help="Reader threads.")
@storage_option
@json_option
@handle_errors
def export_hf_cmd(src: str, out_dir: str, dtype: str, max_shard_size: int, include: tuple[str, ...],
                  rename_map: str | None, all_tensors: bool, config: str | None, overwrite: bool, memory: int,
                  workers: int | None, storage_options: dict, as_json: bool) -> None:
    """Write the model weights of checkpoint SRC as a Hugging Face safetensors model in OUT_DIR.

    Streams block by block (peak memory about --memory, whatever the model size); files are
    fsynced, renamed into place and readable (0644). Optimizer state is left out unless
    --all-tensors. If SRC came from import-hf, its config.json is written back too; for a
    training checkpoint, give the model's config with --config.

    \b
    Examples:
      ragckpt export-hf /ckpt/step_1000 ./llama-hf --dtype bf16
      ragckpt export-hf /ckpt/step_1000 ./llama-hf --config ./llama-base/config.json
      ragckpt export-hf s3://bucket/run/step_1000 ./out --max-shard-size 2GB --include 'model.*' --include 'lm_head.*'
    """
    rmap = load_rename_map(rename_map) if rename_map else None
    ck = ragckpt.open(src, storage_options=storage_options)
    weights = recorded_weights(ck.user)
    pairs = select_tensors(ck.names(), include=list(include) or None, all_tensors=all_tensors, rename_map=rmap,
                           weights=weights)
    total = sum(output_nbytes(ck.meta(n), dtype, weights) for n, _ in pairs)
    del ck
    with progress_bar(total, "exporting", not as_json) as advance:
        res = export_hf(src, out_dir, dtype=dtype, max_shard_size=max_shard_size, include=list(include) or None,
                        rename_map=rmap, all_tensors=all_tensors, overwrite=overwrite, memory_bytes=memory,
                        workers=workers, storage_options=storage_options, progress=advance, config=config)
    if as_json:
        emit_json(res.to_dict())
        return
    click.echo(f"exported {res.tensors} tensors ({human_bytes(res.bytes)}) to {res.out_dir} in "
               f"{len(res.files)} file(s), {res.seconds:.1f}s ({human_rate(res.bytes, res.seconds)})")
    if res.excluded:
        click.echo(f"left out {res.excluded} tensor(s) (optimizer state/extras or not matching --include)")
    if res.cast:
        click.echo(f"cast {res.cast} tensor(s) to {dtype}")
    if res.wrote_config:
        click.echo("wrote config.json" + ("" if config else " (the one recorded in the checkpoint)"))
    elif res.has_config:  # the user's own config.json: left alone, but say so (it may not match the weights)
        click.echo(f"note: kept the config.json already in {res.out_dir} (to replace it, pass --config with "
                   "--overwrite)")
    else:
        click.echo("note: OUT_DIR has no config.json, so from_pretrained cannot load it yet; pass --config "
                   "with the model's config.json or copy one in")


@click.command(name="import-hf")
@click.argument("hf_dir", callback=nonempty_url)
@click.argument("dst")
@click.option("--world-size", "-w", type=click.IntRange(1, MAX_WORLD_SIZE), required=True,
              help="Number of ranks the checkpoint is laid out for (at most 1,048,576).")
@new_layout_options
@click.option("--overwrite", is_flag=True, help="Replace what DST holds (a checkpoint or anything else). The old contents are set aside until the new checkpoint is committed and put back if the run fails (see docs/RESHARD.md).")
@memory_option
@click.option("--workers", type=click.IntRange(min=1), default=None, help="Writer threads (ranks written in parallel).")
@storage_option
@json_option
@handle_errors
def import_hf_cmd(hf_dir: str, dst: str, world_size: int, layout: str, granularity: str | int, overwrite: bool,
                  memory: int, workers: int | None, storage_options: dict, as_json: bool) -> None:
    """Convert a Hugging Face safetensors model (HF_DIR: a directory with model.safetensors or a
    sharded model.safetensors.index.json, or one .safetensors file) into a committed checkpoint for
    --world-size ranks that training can start from. Bit-exact for every dtype.

    \b
    Examples:
      ragckpt import-hf ./Llama-3.2-1B /ckpt/llama_w64 --world-size 64
      ragckpt import-hf ./model /ckpt/m_w8 -w 8 --layout row --json
    """
    m = open_hf_model(hf_dir, storage_options)  # validates every header before anything is written
    m.close()
    # the bar counts rank-buffer bytes, padding included: plan once here for the exact total
    total = CheckpointLayout.build({n: (e.shape, e.dtype) for n, (_, e) in m.entries.items()}, world_size,
                                  layout, granularity).total_bytes()
    with progress_bar(total, "importing", not as_json) as advance:
        res = import_hf(hf_dir, dst, world_size, layout=layout, granularity=granularity, overwrite=overwrite,
                        memory_bytes=memory, workers=workers, storage_options=storage_options, progress=advance)
    if as_json:
        emit_json(res.to_dict())
        return
    click.echo(f"imported {res.tensors} tensors ({human_bytes(res.bytes)}) from {len(res.files)} file(s) into "
               f"{res.dst} for {res.world_size} ranks ({res.layout} layout, {human_bytes(res.padding_bytes)} padding) "
               f"in {res.seconds:.1f}s ({human_rate(res.bytes, res.seconds)})")


commands = [export_hf_cmd, import_hf_cmd]

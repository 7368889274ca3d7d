"""`python -m ragfsdp.train` / `torchrun --nproc-per-node N -m ragfsdp.train`: train a model under
ragfsdp with auto-checkpointing.

Every flag and every config that cannot work (a batch that does not split over the ranks, a plan that
leaves ranks without parameters, a missing `--init-from` checkpoint) is refused with one line on
stderr before a process group starts, so a bad launch costs seconds, not a hung job: exit code 2 for
flag errors, 1 for the others. Without torchrun's environment it runs as one process (world size 1,
through the same engine). The loop is `main(argv)`, callable from tests.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import resource
import sys
import time
from dataclasses import dataclass
from typing import IO, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import ragckpt
import ragfsdp
from ragfsdp import data, models
from ragfsdp.engine import owner_balance, plan_unit

log = logging.getLogger("ragfsdp.train")

OPTIMIZERS = {"adamw": "AdamW", "muon": "Muon", "adam8bit": "Adam8bit"}
# which hyperparameter flags each optimizer takes (Muon has no Adam betas)
_OPT_FLAGS = {"adamw": ("lr", "betas", "eps", "weight_decay"), "adam8bit": ("lr", "betas", "eps", "weight_decay"),
              "muon": ("lr", "weight_decay")}


class UsageError(Exception):
    """A bad flag: exit code 2."""


class ConfigError(Exception):
    """Flags that parse but cannot run together (or on this world size): exit code 1."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(message)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _nonnegative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def _betas(text: str) -> tuple[float, float]:
    parts = text.split(",")
    try:
        b1, b2 = (float(x) for x in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected two numbers as B1,B2, got {text!r}") from None
    if not (0 <= b1 < 1 and 0 <= b2 < 1):
        raise argparse.ArgumentTypeError(f"betas must lie in [0, 1), got {text!r}")
    return b1, b2


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="ragfsdp.train", description=__doc__.split("\n\n")[0],
                epilog="example: torchrun --nproc-per-node 4 -m ragfsdp.train --model tiny-llama --steps 50 "
                       "--ckpt-dir ./ckpt --ckpt-every 10 --keep-last 2")
    p.add_argument("--model", required=True,
                   help=f"one of {', '.join(models.MODELS)}, or a Hugging Face config.json path (random weights)")
    p.add_argument("--steps", type=_positive, required=True, help="train until this global step")
    p.add_argument("--batch-size", type=_positive, default=8, help="global batch, in sequences (split over ranks)")
    p.add_argument("--seq-len", type=_positive, default=64)
    p.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adamw")
    p.add_argument("--lr", type=_nonnegative_float, default=1e-3)
    # left out: the optimizer's own default (torch's, e.g. AdamW's weight decay 0.01, Muon's 0.1)
    p.add_argument("--weight-decay", type=_nonnegative_float, default=None)
    p.add_argument("--betas", type=_betas, default=None, metavar="B1,B2", help="Adam betas (adamw, adam8bit)")
    p.add_argument("--eps", type=_nonnegative_float, default=None, help="Adam epsilon (adamw, adam8bit)")
    p.add_argument("--grad-clip", type=_nonnegative_float, default=0.0, help="clip the global grad norm (0: off)")
    p.add_argument("--seed", type=int, default=0, help="model weights and synthetic data")
    p.add_argument("--mixed-precision", choices=["bf16"], default=None,
                   help="bf16 compute and all-gathers, fp32 master weights and gradient reduction")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto: cuda (nccl) under torchrun when a GPU is there, else cpu (gloo)")
    p.add_argument("--data", default=None, metavar="FILE",
                   help="token file: .npy (1-D integers) or raw .bin (see --data-dtype); default synthetic")
    p.add_argument("--data-dtype", choices=sorted(data.RAW_DTYPES), default="uint16", help="dtype of a raw .bin")
    p.add_argument("--log-json", default=None, metavar="FILE", help="one JSON object per step (rank 0)")
    p.add_argument("--log-every", type=_positive, default=1, help="progress line every N steps (no TTY)")
    p.add_argument("--ckpt-dir", default=None, metavar="URL", help="auto-checkpoint root (path or s3://...)")
    p.add_argument("--ckpt-every", type=_positive, default=None, metavar="N", help="save every N steps")
    p.add_argument("--keep-last", type=_positive, default=None, metavar="K", help="keep the newest K saves")
    p.add_argument("--no-async", action="store_true", help="save in the loop instead of in the background")
    p.add_argument("--export-hf", default=None, metavar="DIR", help="safetensors of the final weights")
    p.add_argument("--init-from", default=None, metavar="URL",
                   help="start from this checkpoint's weights (optimizer fresh) unless --ckpt-dir has one")
    return p


@dataclass
class Env:
    rank: int
    world_size: int
    local_rank: int
    distributed: bool


def _env() -> Env:
    """torchrun's variables, or one process without them."""
    if "WORLD_SIZE" not in os.environ:
        return Env(0, 1, 0, False)
    try:
        world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ.get("RANK", "0"))
        local = int(os.environ.get("LOCAL_RANK", "0"))
    except ValueError:
        raise ConfigError("WORLD_SIZE, RANK and LOCAL_RANK must be integers (run under torchrun)") from None
    if world < 1 or not 0 <= rank < world:
        raise ConfigError(f"RANK={rank} WORLD_SIZE={world} is not a valid rank of the job")
    return Env(rank, world, local, True)


def _check_flags(args: argparse.Namespace) -> None:
    for flag, value in (("--betas", args.betas), ("--eps", args.eps)):
        if value is not None and flag.removeprefix("--") not in _OPT_FLAGS[args.optimizer]:
            raise UsageError(f"{flag} does not apply to --optimizer {args.optimizer}")
    if args.ckpt_dir is None:
        for flag, value in (("--ckpt-every", args.ckpt_every), ("--keep-last", args.keep_last),
                            ("--no-async", args.no_async or None), ("--export-hf", args.export_hf)):
            if value is not None:
                raise UsageError(f"{flag} needs --ckpt-dir (checkpoints go there)")
    if args.model not in models.MODELS and not (args.model.endswith(".json") or os.path.exists(args.model)):
        raise UsageError(f"unknown model {args.model!r}; choose one of {', '.join(models.MODELS)} "
                         "or give a path to a Hugging Face config.json")


def _optimizer_class(name: str) -> type:
    import ragfsdp.optim
    cls = getattr(ragfsdp.optim, OPTIMIZERS[name], None)
    if cls is None:
        raise ConfigError(f"--optimizer {name}: ragfsdp.optim.{OPTIMIZERS[name]} is not in this installation")
    return cls


def _units(model: nn.Module, blocks: list[nn.Module]) -> list[tuple[str, list[str], list[tuple]]]:
    """(unit, parameter names, shapes) for each block and then the root, as fully_shard will group them."""
    taken: set[int] = set()
    units = []
    for i, b in enumerate(blocks):
        named = [(n, p) for n, p in b.named_parameters() if id(p) not in taken]
        taken.update(id(p) for _, p in named)
        units.append((f"block {i}", [n for n, _ in named], [tuple(p.shape) for _, p in named]))
    rest = [(n, p) for n, p in model.named_parameters() if id(p) not in taken]
    units.append(("root", [n for n, _ in rest], [tuple(p.shape) for _, p in rest]))
    return [u for u in units if u[1]]


def _check_plan(model: nn.Module, blocks: list[nn.Module], granularity: Any, world: int, optimizer: str) -> None:
    """Plan every unit for `world` ranks as fully_shard will, before any process group: a plan that
    fails is refused here instead of after the job has started, and so is a plan with tensors kept
    whole (Muon's matrices) that leaves a rank without a single parameter element: more ranks than
    the plan can use, whose flat buffers would be padding only, all-gathered at every step for
    nothing. Plans that split tensors (rows, quantisation blocks) are not held to that: a tiny model
    on many ranks is still a valid job."""
    used = torch.zeros(world, dtype=torch.bool)
    whole = False
    owner_balance.reset()
    try:
        for unit, names, shapes in _units(model, blocks):
            try:
                layout = plan_unit(names, shapes, world, granularity)
            except (ragckpt.LayoutError, ValueError) as e:
                raise ConfigError(f"--optimizer {optimizer} cannot lay out {unit} on {world} ranks: {e}") from None
            size = layout.shard_size
            whole = whole or bool(owner_balance.whole_owned(layout))
            for offset, numel in zip(layout.offsets, layout.numels, strict=True):
                if numel:  # the ranks whose [r*S, (r+1)*S) the tensor's flat range touches
                    used[int(offset) // size:(int(offset) + int(numel) - 1) // size + 1] = True
    finally:
        owner_balance.reset()  # fully_shard starts from even ranks
    n = int(used.sum())
    if whole and n < world:
        raise ConfigError(f"--optimizer {optimizer} keeps tensors whole on one rank: with this model only {n} of "
                          f"{world} ranks would hold any parameter (the others only padding); use at most {n} ranks")


@dataclass
class Job:
    args: argparse.Namespace
    env: Env
    model: nn.Module
    blocks: list[nn.Module]
    vocab: int
    source: data.Source
    opt_cls: type
    device: torch.device
    backend: str


def prepare(args: argparse.Namespace) -> Job:
    """Everything that can be checked without a process group, in the order a user fixes things."""
    _check_flags(args)
    env = _env()
    if args.batch_size % env.world_size:
        raise ConfigError(f"--batch-size {args.batch_size} does not split over {env.world_size} ranks; "
                          f"use a multiple of {env.world_size}")
    opt_cls = _optimizer_class(args.optimizer)
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available() and
                                         "LOCAL_RANK" in os.environ)
    if use_cuda and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is available")
    device = torch.device("cuda", env.local_rank) if use_cuda else torch.device("cpu")
    try:
        model, blocks, vocab = models.build(args.model, args.seed)
    except models.ModelError as e:
        raise ConfigError(str(e)) from None
    limit = models.max_positions_of(model)
    if limit is not None and args.seq_len > limit:
        raise ConfigError(f"--seq-len {args.seq_len} is longer than the model's {limit} positions")
    _check_plan(model, blocks, getattr(opt_cls, "granularity", None), env.world_size, args.optimizer)
    source = data.open_source(args.data, vocab, args.seq_len, args.seed, args.data_dtype)
    source.sample(0)  # a token past the vocabulary or an unreadable file fails here, not at step 1
    if args.init_from is not None:
        try:
            ragckpt.open(args.init_from)
        except ragckpt.RagckptError as e:
            raise ConfigError(f"--init-from {args.init_from}: {e}") from None
    if args.export_hf and os.path.isdir(args.export_hf):
        clash = [f for f in os.listdir(args.export_hf) if f.endswith(".safetensors") or f.endswith(".index.json")]
        if clash:
            raise ConfigError(f"--export-hf {args.export_hf} already holds {clash[0]}; give an empty directory")
    return Job(args, env, model, blocks, vocab, source, opt_cls, device, "nccl" if use_cuda else "gloo")


def _make_optimizer(job: Job) -> Any:
    a = job.args
    values = {"lr": a.lr, "betas": a.betas, "eps": a.eps, "weight_decay": a.weight_decay}
    return job.opt_cls(job.model, **{k: values[k] for k in _OPT_FLAGS[a.optimizer] if values[k] is not None})


def _shard(job: Job) -> None:
    """Each block its own unit, then the root (embeddings, final norm, head), as FSDP2 recipes do."""
    mp = (ragfsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if job.args.mixed_precision == "bf16" else None)
    gran = getattr(job.opt_cls, "granularity", None)
    for b in job.blocks:
        ragfsdp.fully_shard(b, granularity=gran, mp_policy=mp)
    ragfsdp.fully_shard(job.model, granularity=gran, mp_policy=mp)


def _logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    if isinstance(model, models.GPT):
        return model(ids)
    return model(input_ids=ids, use_cache=False).logits


def loss_of(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy over the batch's tokens (each row: seq_len inputs + 1)."""
    logits = _logits(model, batch[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def _peak_memory(device: torch.device) -> tuple[str, int]:
    if device.type == "cuda":
        return "peak_cuda_bytes", int(torch.cuda.max_memory_allocated(device))
    return "peak_rss_bytes", int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _columns(stream: IO[str]) -> int:
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (OSError, ValueError):
        return 0


class Progress:
    """Rank 0's view: a tqdm bar on a terminal, plain lines otherwise (logs, CI); the JSON lines file."""

    def __init__(self, job: Job, first: int, resumed: bool) -> None:
        self.on = job.env.rank == 0
        self.total, self.every = job.args.steps, job.args.log_every
        self.bar = None
        self.json: IO[str] | None = None
        if not self.on:
            return
        if sys.stderr.isatty() and _columns(sys.stderr) > 0:  # a terminal of width 0 would get an empty bar
            with contextlib.suppress(ImportError):
                from tqdm import tqdm
                self.bar = tqdm(total=self.total, initial=first, unit="step", dynamic_ncols=True)
        if job.args.log_json:
            self.json = open(job.args.log_json, "a" if resumed else "w", encoding="utf-8")  # noqa: SIM115

    def step(self, row: dict) -> None:
        if not self.on:
            return
        mem_key = "peak_cuda_bytes" if "peak_cuda_bytes" in row else "peak_rss_bytes"
        mem = f"{row[mem_key] / 2**20:,.0f} MiB"
        if self.json is not None:
            self.json.write(json.dumps(row) + "\n")
            self.json.flush()
        if self.bar is not None:
            self.bar.set_postfix_str(f"loss {row['loss']:.4f} {row['tokens_per_s']:,.0f} tok/s {mem}")
            self.bar.update(1)
        elif row["step"] % self.every == 0 or row["step"] == self.total:
            print(f"step {row['step']}/{self.total} loss {row['loss']:.4f} {row['tokens_per_s']:,.0f} tokens/s "
                  f"{mem_key.removesuffix('_bytes').replace('_', ' ')} {mem}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.json is not None:
            self.json.close()


def _start(job: Job, opt: Any, ckpt: ragfsdp.Checkpointer | None) -> tuple[int, int]:
    """(step, data position) to continue from: the newest checkpoint under --ckpt-dir, else the
    weights of --init-from at step 0, else scratch."""
    a = job.args
    step = ckpt.resume(job.model, opt) if ckpt is not None else 0
    if ckpt is not None and ckpt.resumed_from is not None:
        position = ckpt.resumed_extra.get("data_position")
        if not isinstance(position, int) or isinstance(position, bool):
            position = step * a.batch_size
            log.warning("%s records no data position; continuing at sample %d (step x batch size)",
                        ckpt.resumed_from, position)
        if a.init_from is not None:
            log.info("--init-from %s not used: resuming the job's own checkpoint", a.init_from)
        return step, position
    if a.init_from is not None:
        ck = ragfsdp.load_state(job.model, None, a.init_from)
        opt_state = any(n.startswith("optim.") for n in ck.names())
        if job.env.rank == 0:
            log.info("initialised the weights from %s (%d ranks) at %d ranks; the optimizer starts fresh%s",
                     ck.url, ck.world_size, job.env.world_size,
                     " (its optimizer state is not used)" if opt_state else "")
    return 0, 0


def _mean_and_peak(loss: torch.Tensor, job: Job) -> tuple[float, str, int]:
    key, peak = _peak_memory(job.device)
    if not job.env.distributed:
        return float(loss.detach()), key, peak
    t = torch.stack([loss.detach().float(), torch.tensor(float(peak), device=loss.device)])
    mean = t[:1].clone()
    dist.all_reduce(mean)
    top = t[1:].clone()
    dist.all_reduce(top, op=dist.ReduceOp.MAX)
    return float(mean) / job.env.world_size, key, int(top)


def train(job: Job) -> int:
    a = job.args
    job.model.to(job.device)
    _shard(job)
    opt = _make_optimizer(job)
    ckpt = (ragfsdp.Checkpointer(a.ckpt_dir, every_steps=a.ckpt_every, keep_last=a.keep_last,
                                 async_save=not a.no_async, seed=a.seed) if a.ckpt_dir else None)
    step, position = _start(job, opt, ckpt)
    if job.env.rank == 0:
        log.info("training %s on %d rank(s) (%s, %s) from step %d to %d: batch %d x %d tokens, %s",
                 a.model, job.env.world_size, job.device.type, job.backend, step, a.steps, a.batch_size,
                 a.seq_len, job.source.describe())
    if step >= a.steps and job.env.rank == 0:
        log.info("nothing to train: already at step %d (--steps %d)", step, a.steps)
    progress = Progress(job, step, resumed=step > 0)
    saved_at = step if ckpt is not None and ckpt.resumed_from is not None else None
    try:
        while step < a.steps:
            t0 = time.perf_counter()
            batch = data.local_batch(job.source, position, a.batch_size, job.env.rank, job.env.world_size)
            loss = loss_of(job.model, batch.to(job.device))
            loss.backward()
            norm = ragfsdp.clip_grad_norm_(job.model, a.grad_clip) if a.grad_clip > 0 else None
            opt.step()
            opt.zero_grad()
            step, position = step + 1, position + a.batch_size
            mean, key, peak = _mean_and_peak(loss, job)
            if ckpt is not None and ckpt.maybe_save(step, job.model, opt, extra={"data_position": position}):
                saved_at = step
            dt = time.perf_counter() - t0
            row = {"step": step, "loss": mean, "tokens_per_s": a.batch_size * a.seq_len / dt, key: peak,
                   "step_s": dt, "data_position": position}
            if norm is not None:
                row["grad_norm"] = float(norm)  # before clipping, the same on every rank
            progress.step(row)
        if ckpt is not None:
            if saved_at != step:
                ckpt.save(step, job.model, opt, extra={"data_position": position})
            ckpt.wait()
    finally:
        progress.close()
        if ckpt is not None:
            ckpt.close()
    if a.export_hf and job.env.rank == 0:
        _export(job, ckpt)
    return 0


def _export(job: Job, ckpt: ragfsdp.Checkpointer) -> None:
    url = ckpt.last_committed or ckpt.resumed_from
    config = models.hf_config_of(job.model)
    rep = ragfsdp.export_hf(url, job.args.export_hf, config=config)
    what = "with config.json (loads with from_pretrained)" if config else "without a transformers config"
    log.info("exported %s to %s %s: %d tensors, %.1f MiB in %.2f s", url, job.args.export_hf, what,
             rep.tensors, rep.bytes / 2**20, rep.seconds)


def _log_handler(rank: int) -> logging.Handler:
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(logging.Formatter("[ragfsdp] %(message)s"))
    h.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    return h


def _fail(message: str, rank: int, code: int, *, every_rank: bool = False) -> int:
    """Before the job starts every rank finds the same error, so rank 0 alone says it; during
    training the failing rank says it, with its rank."""
    if every_rank:
        print(f"ragfsdp.train: error: rank {rank}: {message}", file=sys.stderr, flush=True)
    elif rank == 0:
        print(f"ragfsdp.train: error: {message}", file=sys.stderr, flush=True)
    return code


def main(argv: list[str] | None = None) -> int:
    """Parse, check, train; the exit code (0, 1 or 2). Errors are one line on rank 0's stderr."""
    rank = int(os.environ.get("RANK", "0")) if os.environ.get("RANK", "0").isdigit() else 0
    try:
        args = build_parser().parse_args(argv)
        job = prepare(args)
    except UsageError as e:
        return _fail(str(e), rank, 2)
    except (ConfigError, data.DataError, models.ModelError) as e:
        return _fail(str(e), rank, 1)
    except SystemExit as e:  # --help
        return int(e.code or 0)
    handler = _log_handler(job.env.rank)
    root = logging.getLogger("ragfsdp")
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    started = False
    try:
        if job.env.distributed and not dist.is_initialized():
            torch.set_num_threads(max(1, min(torch.get_num_threads(), (os.cpu_count() or 1) // job.env.world_size)))
            if job.device.type == "cuda":
                torch.cuda.set_device(job.device)
            dist.init_process_group(job.backend, rank=job.env.rank, world_size=job.env.world_size)
            started = True
        return train(job)
    except (ragfsdp.CheckpointSaveError, ragckpt.RagckptError, data.DataError) as e:
        return _fail(str(e).splitlines()[0], job.env.rank, 1, every_rank=job.env.distributed)
    except KeyboardInterrupt:
        return _fail("interrupted (the checkpoint in flight, if any, was finished first)", job.env.rank, 130)
    finally:
        if started:
            dist.destroy_process_group()
        root.removeHandler(handler)
        root.setLevel(old_level)


if __name__ == "__main__":
    sys.exit(main())

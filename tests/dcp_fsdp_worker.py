"""Multi-process FSDP2 (CPU, gloo) half of the DCP conversion tests; run by tests/convert/test_dcp_fsdp.py.

    python tests/dcp_fsdp_worker.py save DCP_DIR REF_PT PORT NPROCS
        trains a tiny FSDP2 model a few Adam steps, saves model + optimizer (+ two DTensors sharded on
        inner dims, to exercise non-row boxes) with torch.distributed.checkpoint.save, and writes the
        reference: every tensor's `full_tensor()` and the optimizer hyperparameters.
    python tests/dcp_fsdp_worker.py load DCP_DIR OUT_PT PORT NPROCS
        builds a fresh FSDP2 model (other seed, other lr) at NPROCS ranks, loads DCP_DIR with stock
        dcp.load + set_state_dict, and writes what the model and optimizer then hold, in the same form.

Both sides record state the same way, so the test compares them byte for byte.
"""

from __future__ import annotations

import functools
import os
import sys
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

OPTS = StateDictOptions(flatten_optimizer_state_dict=True)
HPARAMS = ("lr", "betas", "eps", "weight_decay", "amsgrad")


class TinyNet(nn.Module):
    """Row counts 22, 7, 5 shard unevenly on 2 and 3 ranks (and 5 rows leave a rank nearly empty)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(13, 22)
        self.mid = nn.Linear(22, 7)
        self.out = nn.Linear(7, 5, bias=False)
        self.register_buffer("scale", torch.linspace(-2, 2, 5).to(torch.bfloat16))
        self.register_buffer("seen", torch.tensor([3, 1, 4], dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.mid(torch.relu(self.inp(x))))) * self.scale.float()


def build(seed: int, lr: float) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = TinyNet()
    for m in (model.inp, model.mid, model.out):
        fully_shard(m)
    fully_shard(model)
    return model, torch.optim.Adam(model.parameters(), lr=lr, betas=(0.8, 0.95), eps=1e-7)


def full(v: object) -> object:
    return v.full_tensor() if isinstance(v, DTensor) else (v.clone() if isinstance(v, torch.Tensor) else v)


def record(model: nn.Module, opt: torch.optim.Optimizer, tp: dict[str, DTensor]) -> dict:
    """Every tensor as a full tensor (collective: all ranks call it) plus the hyperparameters."""
    msd, osd = get_state_dict(model, opt, options=OPTS)
    out: dict = {"model": {k: full(v) for k, v in msd.items()},
                 "optim": {k: full(v) for k, v in osd.items() if k.startswith("state.")},
                 "tp": {k: full(v) for k, v in tp.items()}}
    out["hparams"] = [{k: g[k] for k in HPARAMS} for g in opt.param_groups]
    out["params"] = {n: full(p.data) for n, p in model.named_parameters()}
    return out


def tp_tensors(mesh: object, fill: bool) -> dict[str, DTensor]:
    g = torch.Generator().manual_seed(7)
    col = torch.randn(6, 10, generator=g) if fill else torch.zeros(6, 10)
    cube = (torch.randn(3, 5, 4, generator=g) if fill else torch.zeros(3, 5, 4)).to(torch.bfloat16)
    return {"col": distribute_tensor(col, mesh, [Shard(1)]), "cube": distribute_tensor(cube, mesh, [Shard(2)])}


def gloo_worker(body: Callable[..., None]) -> Callable[..., None]:
    """A test worker process (started by mp.spawn): its body, then a barrier and the end of its
    process group, then `os._exit`. A traceback and exit 1 on any failure. Leaving without running
    C++ static destructors: gloo/DCP worker threads torn down at interpreter exit occasionally abort
    ("terminate called without an active exception") after all work is done."""

    @functools.wraps(body)
    def run(*args: object) -> None:
        try:
            body(*args)
            dist.barrier()
            dist.destroy_process_group()
        except BaseException:
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

    return run


def train(rank: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model and optimizer every save test starts from: three Adam steps on this rank's data."""
    model, opt = build(seed=0, lr=1e-2)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(3):
        model(torch.randn(4, 13, generator=g)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


@gloo_worker
def run(rank: int, world: int, port: int, mode: str, dcp_dir: str, out_pt: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    if mode == "save":
        model, opt = train(rank)
        tp = tp_tensors(mesh, fill=True)
        msd, osd = get_state_dict(model, opt, options=OPTS)
        dcp.save({"model": msd, "optim": osd, "tp": tp}, checkpoint_id=dcp_dir)
    else:
        model, opt = build(seed=123, lr=5e-4)
        tp = tp_tensors(mesh, fill=False)
        msd, osd = get_state_dict(model, opt, options=OPTS)
        dcp.load({"model": msd, "optim": osd, "tp": tp}, checkpoint_id=dcp_dir)
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd, options=OPTS)
    rec = record(model, opt, tp)
    rec["local_rows"] = {n: int(p.to_local().shape[0]) for n, p in model.named_parameters()}
    if rank == 0:
        torch.save(rec, out_pt)


if __name__ == "__main__":
    mode, dcp_dir, out_pt, port, nprocs = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    mp.spawn(run, args=(nprocs, port, mode, dcp_dir, out_pt), nprocs=nprocs)

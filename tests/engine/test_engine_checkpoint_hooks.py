"""ragfsdp.state / load_state: save at 2 ranks, load at 3 (bit-exact), and load an HF import."""

from __future__ import annotations

import torch
from safetensors.torch import save_file

import ragckpt
import ragfsdp
from tests.engine.dist_helpers import run_ranks
from tests.engine.models import make_net
from tests.engine.test_fully_shard_correctness import merge, shard_net


def _pieces(net) -> dict:
    out: dict = {}
    for g in ragfsdp.flat_groups(net):
        for pc in g.pieces():
            out.setdefault(pc.name, []).append((pc.flat_start, g.shard[pc.offset:pc.offset + pc.length].clone()))
    return out


def save_at(rank: int, world: int, url: str) -> None:
    net = make_net(seed=3)
    shard_net(net)
    ragckpt.save_shard(url, **ragfsdp.state(net), save_id="step-1")
    torch.distributed.barrier()
    if rank == 0:
        ragckpt.commit(url)
    torch.distributed.barrier()


def load_at(rank: int, world: int, url: str) -> dict:
    net = make_net(seed=99)  # other values: the load must replace them all
    shard_net(net)
    ragfsdp.load_state(net, None, url)
    x = torch.randn(4, 7, generator=torch.Generator().manual_seed(5))
    return {"pieces": _pieces(net), "out": net(x).detach()}


def test_save_two_load_three(tmp_path):
    url = str(tmp_path / "ck")
    run_ranks(save_at, 2, tmp_path, url)
    res = run_ranks(load_at, 3, tmp_path, url)
    ref = make_net(seed=3)
    shapes = {n: tuple(p.shape) for n, p in ref.named_parameters()}
    got = merge([r["pieces"] for r in res], shapes)
    for n, p in ref.named_parameters():
        assert torch.equal(got[n], p.detach()), n
    x = torch.randn(4, 7, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(res[0]["out"], ref(x).detach())


def test_load_from_hf_import_bf16(tmp_path):
    ref = make_net(seed=3)
    hf = tmp_path / "hf"
    hf.mkdir()
    save_file({n: p.detach().to(torch.bfloat16).contiguous() for n, p in ref.state_dict().items()},
              str(hf / "model.safetensors"))
    url = str(tmp_path / "imported")
    ragckpt.import_hf(str(hf), url, 2)
    res = run_ranks(load_at, 2, tmp_path, url)
    shapes = {n: tuple(p.shape) for n, p in ref.named_parameters()}
    got = merge([r["pieces"] for r in res], shapes)
    for n, p in ref.named_parameters():
        assert torch.equal(got[n], p.detach().to(torch.bfloat16).float()), n


def test_missing_tensor_is_named(tmp_path):
    ref = make_net(seed=3)
    hf = tmp_path / "hf"
    hf.mkdir()
    sd = {n: p.detach().contiguous() for n, p in ref.state_dict().items() if n != "head.bias"}
    save_file(sd, str(hf / "model.safetensors"))
    url = str(tmp_path / "imported")
    ragckpt.import_hf(str(hf), url, 1)
    net = make_net()
    shard_net(net)
    try:
        ragfsdp.load_state(net, None, url)
    except ragckpt.UnknownNameError as e:
        assert "head.bias" in str(e)
    else:
        raise AssertionError("a missing tensor loaded")

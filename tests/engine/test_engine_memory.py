"""A unit's unsharded parameters are freed after its forward and after the backward (storage sizes)."""

from __future__ import annotations

import torch
from torch import nn

import ragfsdp
from tests.engine.models import make_net
from tests.engine.test_fully_shard_correctness import shard_net


def _storage_bytes(mod: nn.Module) -> int:
    return sum(p.untyped_storage().nbytes() for p in mod.parameters(recurse=False))


def test_blocks_freed_after_forward_and_backward():
    net = make_net()
    shard_net(net)
    seen: list[int] = []
    for b in net.blocks:
        b.up.register_forward_hook(lambda m, a, o: seen.append(_storage_bytes(m)))
    out = net(torch.randn(3, 7))
    assert all(s > 0 for s in seen)  # gathered while its forward ran
    for b in net.blocks:
        assert _storage_bytes(b.up) == 0 and _storage_bytes(b.down) == 0
    out.sum().backward()
    for g in ragfsdp.flat_groups(net):
        assert g.full.untyped_storage().nbytes() == 0 and g.full_grad is None and g.grad is not None
    assert all(p.grad is None for p in net.parameters())

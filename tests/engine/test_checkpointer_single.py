"""`ragfsdp.autockpt.Checkpointer` in one process: background saves commit, retention keeps the newest
K, a resumed run continues bit for bit as the uninterrupted one (reference: the same loop run straight
through), and a failed background save is raised in the loop at the next step."""

from __future__ import annotations

import os

import pytest
import torch

import ragckpt
import ragfsdp
from ragfsdp.autockpt import Checkpointer, CheckpointSaveError


def _build() -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    ragfsdp.fully_shard(m[0])
    ragfsdp.fully_shard(m[2])
    ragfsdp.fully_shard(m)
    return m


def _train(m, last: int, start: int, ck: Checkpointer | None) -> list[float]:
    losses = []
    for step in range(start + 1, last + 1):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        loss = m(x).square().mean()
        loss.backward()
        losses.append(loss.item())
        for fg in ragfsdp.flat_groups(m):
            fg.shard.sub_(0.1 * fg.grad)
            fg.grad = None
        if ck is not None:
            ck.maybe_save(step, m, None, extra={"data_position": step * 4})
    return losses


def _shards(m) -> list[torch.Tensor]:
    return [fg.shard.clone() for fg in ragfsdp.flat_groups(m)]


@pytest.mark.parametrize("async_save", [True, False])
def test_resume_continues_bit_for_bit_and_keeps_the_last_k(tmp_path, async_save):
    root = str(tmp_path / "run")
    ref_model = _build()
    ref = _train(ref_model, 6, 0, None)
    ck = Checkpointer(root, every_steps=2, keep_last=2, async_save=async_save)
    first = _train(_build(), 4, 0, ck)
    ck.wait()
    ck.close()
    rows = ragckpt.list_checkpoints(root)
    assert [ragckpt.step_of(r["url"]) for r in rows] == [2, 4] and all(r["committed"] for r in rows)
    assert ragckpt.open(rows[-1]["url"]).verify().ok
    ck2 = Checkpointer(root, every_steps=2, keep_last=2, async_save=async_save)
    m2 = _build()
    assert ck2.resume(m2) == 4 and ck2.resumed_extra == {"data_position": 16}
    second = _train(m2, 6, 4, ck2)
    ck2.wait()
    ck2.close()
    assert first + second == ref
    for a, b in zip(_shards(m2), _shards(ref_model), strict=True):
        assert torch.equal(a, b)
    # steps 2 and 4 went when 6 committed; never anything the checkpointer did not make
    assert sorted(ragckpt.step_of(r["url"]) for r in ragckpt.list_checkpoints(root)) == [4, 6]


def test_retention_never_touches_what_it_did_not_make(tmp_path):
    root = tmp_path / "run"
    ragckpt.write_global({"w": torch.ones(3)}, str(root / "step-1"), 1, user={"step": 1})
    ck = Checkpointer(str(root), every_steps=1, keep_last=1, async_save=False)
    _train(_build(), 3, 0, ck)
    ck.close()
    assert sorted(ragckpt.step_of(r["url"]) for r in ragckpt.list_checkpoints(str(root))) == [1, 3]


def test_a_failed_background_save_is_raised_at_the_next_step(tmp_path):
    root = tmp_path / "run"
    os.makedirs(root)
    (root / "step-2").write_text("a file where the save must go")  # every write under it fails
    ck = Checkpointer(str(root), every_steps=2, async_save=True)
    m = _build()
    _train(m, 2, 0, ck)
    with pytest.raises(CheckpointSaveError, match="step 2"):
        ck.wait()
    ck.close()
    assert (root / "step-2").read_text() == "a file where the save must go"


def test_resume_with_nothing_there_starts_from_scratch(tmp_path):
    ck = Checkpointer(str(tmp_path / "empty"), every_steps=5)
    assert ck.resume(_build()) == 0 and ck.resumed_from is None
    ck.close()


def test_a_restart_clears_its_dead_save_that_stopped_before_the_root_document(tmp_path):
    """A job killed right after its save of step 2 claimed the directory (before rank 0 wrote
    zarr.json) leaves only the claim; the restarted job (a new job token, so another save id) must
    not be refused at step 2 forever: it recognises a checkpointer's claim of that step and clears it."""
    from ragckpt.storage import store as store_mod
    from ragfsdp.autockpt import retention

    root = tmp_path / "run"
    url = str(root / "step-2")
    pid = os.fork()
    if pid == 0:  # the earlier run: dies at its first object after the claim
        real = store_mod.LocalStore.write

        def die(self, key, parts, **k):
            if not key.endswith(".ragckpt-save"):
                os._exit(9)
            return real(self, key, parts, **k)
        store_mod.LocalStore.write = die
        m = _build()
        st = ragfsdp.state(m)
        ragckpt.save_shard(url, st["rank"], st["buffers"], st["layout"], save_id=retention.save_id("0" * 16, 2))
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 9
    assert ragckpt.save_claim(url)["save_id"] == "ragfsdp-0000000000000000-step-2"
    with pytest.raises(ragckpt.DestinationError, match="another save 'ragfsdp-0000000000000000-step-2'"):
        ragckpt.save_shard(url, 0, ragfsdp.state(_build())["buffers"], ragfsdp.state(_build())["layout"],
                           save_id="someone-else")
    ck = Checkpointer(str(root), every_steps=2, async_save=False)
    _train(_build(), 2, 0, ck)
    ck.close()
    assert ragckpt.open(url).verify().ok and ragckpt.save_claim(url) is None

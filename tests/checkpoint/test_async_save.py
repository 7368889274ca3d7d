"""Background saves (`ragckpt.save_shard_async`, `StagingBuffers`, FSDP2 `async_save_state_dict`): the
call returns once the buffers are copied, the engine may change them at once, and the checkpoint
holds the values of the moment of the call. References: the dense state the buffers were cut from,
read back through `write_global`'s independent path; the FSDP2 half runs on a 1-rank gloo group
(tests/integrations/test_state_dict_fsdp2.py saves in the background from 3 processes)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

import ragckpt
import ragckpt.checkpoint.background as background
from ragckpt.integrations.fsdp2 import async_save_state_dict, load_state_dict
from tests.helpers import assert_bit_equal, odd_state
from tests.integrations.test_state_dict_fsdp2 import small_state

W = 3


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, torch.Tensor], ragckpt.Checkpoint]:
    """Every dtype and odd shape, written for W ranks by write_global: its rank buffers are what an
    engine's would hold."""
    state = odd_state()
    url = str(tmp_path_factory.mktemp("async_ref") / "ref")
    ragckpt.write_global(state, url, world_size=W, layout="ragged", granularity="row")
    return state, ragckpt.open(url)


def rank_buffers(ck: ragckpt.Checkpoint, rank: int) -> dict[str, torch.Tensor]:
    return {b.name: ck.read_rank(b.name, rank) for b in ck.layout.buffers}


def scribble(tensors: dict[str, torch.Tensor]) -> None:
    """What a training step does to the buffers right after the save returned."""
    for t in tensors.values():
        t.view(torch.uint8).fill_(0x5A)


def check_holds(url: str, state: dict[str, torch.Tensor]) -> None:
    ck = ragckpt.open(url)
    assert sorted(ck.names()) == sorted(state)
    for name, t in state.items():
        assert_bit_equal(ck.read(name), t, name)
    assert ck.verify().ok


class HeldWriter:
    """Holds the writer thread's first write until `release()`: a save is then provably in flight."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, module: object = background, name: str = "write_shard") -> None:
        self.gate = threading.Event()
        self.calls = 0
        real = getattr(module, name)

        def held(*args: object, **kwargs: object) -> dict:
            self.calls += 1
            if self.calls == 1:
                assert self.gate.wait(30), "the test never released the writer"
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, held)

    def release(self) -> None:
        self.gate.set()


def test_save_shard_async_returns_before_writing_and_keeps_the_values_of_the_call(reference, tmp_path: Path,
                                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    state, ck = reference
    held = HeldWriter(monkeypatch)
    url = str(tmp_path / "ck")
    futures, rngs = {}, {}
    for r in range(W):
        bufs = rank_buffers(ck, r)
        rngs[r] = torch.arange(16, dtype=torch.uint8) + r
        rng = rngs[r].clone()
        user = {"step": 5, "tags": ["a"]}
        futures[r] = ragckpt.save_shard_async(url, r, bufs, ck.layout, extra={"rng": rng}, extra_meta={"at": str(r)},
                                              user=user, save_id="s5")
        scribble(bufs)
        rng.fill_(0)
        user["step"] = 6  # the caller's dict moves on too
        user["tags"].append("b")
    assert not futures[0].done()  # rank 0's write is held, yet every call returned
    held.release()
    ragckpt.commit(url, rank_manifests={r: f.result(timeout=60) for r, f in futures.items()})
    check_holds(url, state)
    done = ragckpt.open(url)
    assert done.user["step"] == 5 and done.user["tags"] == ["a"]
    for r in range(W):
        tensors, strings = done.extra(r)
        assert torch.equal(tensors["rng"], rngs[r]) and strings == {"at": str(r)}


def test_staging_is_reused_and_a_save_waits_for_the_previous_one(reference, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Two saves of rank 0 with one StagingBuffers: the second copies into the memory the first is
    still writing from only once the first is done, so each checkpoint holds its own values."""
    state, ck = reference
    later_state = odd_state(seed=1)  # what the engine holds at the second save
    later_url = str(tmp_path / "later_ref")
    ragckpt.write_global(later_state, later_url, world_size=W, layout="ragged", granularity="row")
    later = ragckpt.open(later_url)
    held = HeldWriter(monkeypatch)
    staging = ragckpt.StagingBuffers()
    first, second = str(tmp_path / "first"), str(tmp_path / "second")
    bufs = rank_buffers(ck, 0)
    f1 = ragckpt.save_shard_async(first, 0, bufs, ck.layout, staging=staging)
    kept = {name: t.data_ptr() for name, t in staging._buffers.items()}  # noqa: SLF001
    assert staging.nbytes == sum(t.numel() * t.element_size() for t in bufs.values())
    for name, t in rank_buffers(later, 0).items():  # training moved on, in the same memory
        bufs[name].copy_(t)
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(f2=ragckpt.save_shard_async(second, 0, bufs, ck.layout,
                                                                               staging=staging)))
    t.start()
    t.join(0.5)
    assert t.is_alive() and not f1.done()  # waiting for the first save to let go of the buffers
    held.release()
    t.join(30)
    docs2 = {0: out["f2"].result(timeout=60)}
    assert {name: b.data_ptr() for name, b in staging._buffers.items()} == kept  # noqa: SLF001 - same memory
    docs1 = {0: f1.result(timeout=60)}
    for r in range(1, W):  # the other ranks, saved the plain way
        docs1[r] = ragckpt.save_shard(first, r, rank_buffers(ck, r), ck.layout)
        docs2[r] = ragckpt.save_shard(second, r, rank_buffers(later, r), ck.layout)
    ragckpt.commit(first, rank_manifests=docs1)
    ragckpt.commit(second, rank_manifests=docs2)
    check_holds(first, state)
    check_holds(second, later_state)
    staging.release()
    assert staging.nbytes == 0


def test_saves_started_at_once_from_two_threads_take_turns_with_one_staging(reference, tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Two threads start a save of rank 0 with one StagingBuffers at the same moment, one with the
    reference values and one with other values. A slow host copy opens the window in which, without
    taking turns, the second save copied into buffers the first was still filling or writing from
    (checkpoints holding the other save's values, verified all the same)."""
    state, ck = reference
    other_state = odd_state(seed=3)
    other_url = str(tmp_path / "other_ref")
    ragckpt.write_global(other_state, other_url, world_size=W, layout="ragged", granularity="row")
    other = ragckpt.open(other_url)
    real_take = ragckpt.StagingBuffers.take

    def slow_take(self, name, numel, dtype):  # noqa: ANN001, ANN202
        time.sleep(0.02)
        return real_take(self, name, numel, dtype)

    monkeypatch.setattr(ragckpt.StagingBuffers, "take", slow_take)
    staging = ragckpt.StagingBuffers()
    for trial in range(3):
        urls = {src: str(tmp_path / f"{trial}_{i}") for i, src in enumerate((ck, other))}
        futures: dict = {}
        start = threading.Barrier(2)

        def save(src: ragckpt.Checkpoint, url: str, start: threading.Barrier, futures: dict) -> None:
            bufs = rank_buffers(src, 0)
            start.wait()
            futures[src] = ragckpt.save_shard_async(url, 0, bufs, ck.layout, staging=staging)
            scribble(bufs)

        threads = [threading.Thread(target=save, args=(src, urls[src], start, futures)) for src in (ck, other)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for src, want in ((ck, state), (other, other_state)):
            docs = {0: futures[src].result(timeout=60)}
            docs.update({r: ragckpt.save_shard(urls[src], r, rank_buffers(src, r), ck.layout) for r in range(1, W)})
            ragckpt.commit(urls[src], rank_manifests=docs)
            check_holds(urls[src], want)


def test_bad_arguments_raise_at_the_call_and_storage_errors_from_the_future(reference, tmp_path: Path) -> None:
    state, ck = reference
    bufs = rank_buffers(ck, 1)
    url = tmp_path / "bad"
    with pytest.raises(ragckpt.LayoutError, match="rank 1: buffer 'nope' is not in the layout"):
        ragckpt.save_shard_async(str(url), 1, {**bufs, "nope": torch.zeros(1)}, ck.layout)
    name = ck.layout.buffers[0].name
    with pytest.raises(ragckpt.LayoutError, match=f"rank 1: buffer '{name}' has .* elements, layout says"):
        ragckpt.save_shard_async(str(url), 1, {**bufs, name: bufs[name][:-1]}, ck.layout)
    assert not url.exists()  # refused before anything was copied or written
    fut = ragckpt.save_shard_async(ck.url, 1, bufs, ck.layout)  # into a committed checkpoint
    with pytest.raises(ragckpt.DestinationExistsError, match="already committed"):
        fut.result(timeout=60)
    check_holds(ck.url, state)  # and it is untouched


def test_padding_that_is_not_zero_is_refused_at_the_call(tmp_path: Path) -> None:
    """The planner pads rank buffers; a save refuses stray values there, at the call as for any bad
    argument (checked on the host copy), before anything is written."""
    lay = ragckpt.CheckpointLayout.build({"a": ((7, 3), "float32"), "b": ((5,), "float32")}, 4, "ragged",
                                         granularity="row")
    sizes = lay.rank_sizes(0)
    padded = next(r for r in range(4) if int(sizes[r]) > int(lay.layout_of(0).rank_segments(r).length.sum()))
    buf = torch.full((int(sizes[padded]),), 3.0)
    with pytest.raises(ragckpt.LayoutError, match=f"rank {padded}: buffer 'float32' holds non-zero values in layout padding"):
        ragckpt.save_shard_async(str(tmp_path / "p"), padded, {"float32": buf}, lay)
    assert not (tmp_path / "p").exists()


# -- FSDP2 ---------------------------------------------------------------------------------------------

def values(state: dict) -> dict:
    """A detached copy of what a small_state holds, for comparing after the live one changed."""
    out = {}
    for section, entries in state.items():
        for k, v in entries.items():
            v = v.full_tensor() if hasattr(v, "full_tensor") else v
            out[f"{section}.{k}"] = v.clone() if isinstance(v, torch.Tensor) else v
    return out


def mutate(state: dict) -> None:
    """An optimizer step, in place, on the memory the save copied from."""
    state["model"]["w"].to_local().add_(100.0)
    state["model"]["r"].to_local().mul_(-1.0)
    state["model"]["b"].add_(9)
    state["optim"]["state.w.step"].add_(1.0)


def test_async_save_state_dict_saves_the_state_of_the_call(group: None, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import ragckpt.integrations.fsdp2 as sd

    held = HeldWriter(monkeypatch, sd, "save_shard")  # the first save's write waits for the mutations below
    staging = ragckpt.StagingBuffers()
    live = small_state()
    urls, want, futures = [], [], []
    for i in range(2):  # two saves in a row with one staging: each keeps its own moment
        want.append(values(live))
        urls.append(str(tmp_path / f"step{i}"))
        user = {"step": i, "seen": [i]}
        futures.append(async_save_state_dict(urls[-1], live, user=user, staging=staging))
        mutate(live)
        user["step"] = -1
        user["seen"].append(-1)
        if i == 0:
            assert not futures[0].done()
            threading.Timer(0.3, held.release).start()  # the second call waits for the first save's staging
    for fut in futures:
        fut.result(timeout=60)
    assert staging.nbytes > 0
    for url, expect in zip(urls, want, strict=True):
        dst = small_state(fill=0.0)
        load_state_dict(url, dst)
        got = values(dst)
        for k, v in expect.items():
            if isinstance(v, torch.Tensor):
                assert_bit_equal(got[k], v, k)
        assert got["optim.param_groups.w.lr"] == 0.5
    assert ragckpt.open(urls[1]).user["step"] == 1 and ragckpt.open(urls[1]).user["seen"] == [1]


def test_async_save_state_dict_failure_is_raised_by_the_future(group: None, tmp_path: Path) -> None:
    url = str(tmp_path / "done")
    async_save_state_dict(url, small_state()).result(timeout=60)
    fut = async_save_state_dict(url, small_state(fill=1.0))
    with pytest.raises(ragckpt.DestinationExistsError, match=r"save_state_dict to .*rank 0 failed to write its shard"):
        fut.result(timeout=60)
    fut = async_save_state_dict(str(tmp_path / "x"), [1, 2])  # the checks' failures come from the future too
    with pytest.raises(ragckpt.RagckptError, match="rank 0 failed to check its state dict: TypeError: the state dict "
                                                   "must be a mapping, got list"):
        fut.result(timeout=60)
    dst = small_state(fill=0.0)
    load_state_dict(url, dst)
    assert torch.equal(dst["model"]["w"].to_local(), small_state()["model"]["w"].to_local())


def test_a_save_into_the_checkpoint_a_background_save_still_writes_waits_for_it(tmp_path, monkeypatch):
    """save_shard_async then save_shard of the same rank into the same directory (from an adversarial
    review, 3 ranks under torchrun): both wrote the rank's objects at once, and the commit recorded one
    save's checksums over the other's data: a corrupt checkpoint, or a valid one equal to neither."""
    url = str(tmp_path / "ck")
    lay = ragckpt.CheckpointLayout.build({"w": ((64, 8), "float32")}, 1, "row")
    gate, order = threading.Event(), []
    real = background.write_shard

    def slow_write(*a, **k):
        gate.wait(10)  # the background write is still going when save_shard starts
        out = real(*a, **k)
        order.append("async")
        return out

    monkeypatch.setattr(background, "write_shard", slow_write)
    a, b = torch.arange(512.0), torch.arange(512.0) + 1000
    fut = ragckpt.save_shard_async(url, 0, {"float32": a}, lay)
    threading.Timer(0.3, gate.set).start()
    doc = ragckpt.save_shard(url, 0, {"float32": b}, lay)
    order.append("sync")
    assert order == ["async", "sync"] and fut.done()
    ragckpt.commit(url, rank_manifests={0: doc})
    ck = ragckpt.open(url)
    assert ck.verify().ok
    assert_bit_equal(ck.read("w"), b.reshape(64, 8))
    # and a commit right after a background save waits for it too, rather than reading half its records
    url2 = str(tmp_path / "ck2")
    gate.clear()
    fut = ragckpt.save_shard_async(url2, 0, {"float32": a}, lay)
    threading.Timer(0.3, gate.set).start()
    ragckpt.commit(url2)
    assert fut.done()
    assert_bit_equal(ragckpt.open(url2).read("w"), a.reshape(64, 8))

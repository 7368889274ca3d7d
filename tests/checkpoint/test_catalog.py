"""The library's checkpoint listing (`ragckpt.list_checkpoints`), "latest committed" and the
marker-first removal that a checkpointer's retention and resume rely on."""

from __future__ import annotations

import os

import pytest
import torch

import ragckpt
from ragckpt.checkpoint import manifest as mf


def _save(url: str, step: int, *, commit: bool = True, ranks: int = 2) -> None:
    state = {"w": torch.arange(12, dtype=torch.float32).reshape(4, 3) + step}
    layout = ragckpt.CheckpointLayout.build({"w": ((4, 3), "float32")}, ranks)
    recs = []
    for r in range(ranks):
        flat = torch.zeros(int(layout.rank_sizes(0)[r]))
        seg = layout.layout_of(0).rank_segments(r)
        for i in range(len(seg)):
            o, s, n = int(seg.offset[i]), int(seg.flat_start[i]), int(seg.length[i])
            flat[o:o + n] = state["w"].reshape(-1)[s:s + n]
        recs.append(ragckpt.save_shard(url, r, {"float32": flat}, layout, user={"step": step}))
    if commit:
        ragckpt.commit(url, rank_manifests=recs)


def test_listing_states_steps_and_latest(tmp_path):
    root = tmp_path / "run"
    _save(str(root / "step-2"), 2)
    _save(str(root / "step-10"), 10)
    _save(str(root / "step-12"), 12, commit=False)  # a save still running or killed
    os.makedirs(root / "notes")
    (root / "notes" / "readme.txt").write_text("not a checkpoint")
    rows = ragckpt.list_checkpoints(str(root), long=True)
    by_name = {r["url"].rsplit("/", 1)[-1]: r for r in rows}
    assert sorted(by_name) == ["step-10", "step-12", "step-2"]
    assert by_name["step-10"]["committed"] and by_name["step-2"]["committed"]
    assert not by_name["step-12"]["committed"]
    assert not {"damaged", "unreadable"} & by_name["step-12"].keys()  # merely unfinished
    assert by_name["step-10"]["step"] == 10 and by_name["step-10"]["world_size"] == 2
    ck = ragckpt.open(by_name["step-10"]["url"])
    assert by_name["step-10"]["bytes"] == ck.layout.total_bytes()
    # the newest committed by step number, not by name order ("step-2" sorts after "step-10")
    assert ragckpt.latest_committed(rows)["url"] == by_name["step-10"]["url"]
    assert ragckpt.step_of(by_name["step-2"]["url"]) == 2 and ragckpt.step_of(str(root / "notes")) is None


def test_nothing_there_is_an_error_not_an_empty_listing(tmp_path):
    with pytest.raises(ragckpt.NothingThereError, match="no such directory"):
        ragckpt.list_checkpoints(str(tmp_path / "typo"))
    (tmp_path / "f").write_text("x")
    with pytest.raises(ragckpt.NothingThereError, match="is a file"):
        ragckpt.list_checkpoints(str(tmp_path / "f"))
    assert ragckpt.list_checkpoints(str(tmp_path / "f").rsplit("/", 1)[0]) == []
    assert ragckpt.latest_committed([]) is None


def test_remove_checkpoint_deletes_the_marker_first(tmp_path, monkeypatch):
    url = str(tmp_path / "step-3")
    _save(url, 3)
    from ragckpt.storage.store import LocalStore

    deleted: list[str] = []
    real = LocalStore.delete

    def spy(self, key):
        deleted.append(key)
        return real(self, key)

    monkeypatch.setattr(LocalStore, "delete", spy)
    ragckpt.remove_checkpoint(url)
    assert deleted[0] == mf.COMMIT_KEY and deleted[-1] == mf.ROOT_META_KEY
    assert not os.path.exists(url)
    ragckpt.remove_checkpoint(url)  # already gone: nothing to do


def test_listing_on_s3(s3):
    opts = s3.storage_options
    state = {"w": torch.ones(4, 3)}
    ragckpt.write_global(state, f"{s3.url}/run/step-1", 2, user={"step": 1}, storage_options=opts)
    ragckpt.write_global(state, f"{s3.url}/run/step-4", 2, user={"step": 4}, storage_options=opts)
    rows = ragckpt.list_checkpoints(f"{s3.url}/run", storage_options=opts, long=True)
    assert [r["step"] for r in rows] == [1, 4] and all(r["committed"] for r in rows)
    assert ragckpt.latest_committed(rows)["url"].endswith("/run/step-4")
    ragckpt.remove_checkpoint(f"{s3.url}/run/step-4", storage_options=opts)
    rows = ragckpt.list_checkpoints(f"{s3.url}/run", storage_options=opts)
    assert [ragckpt.step_of(r["url"]) for r in rows] == [1]

"""export-hf --overwrite never leaves a loadable mix of two models: a failed or killed export keeps
the old model as it was (or, on object storage, leaves no index to load), its hidden temporary files
are removed by the next export, and files that are not this tool's temporaries are never touched."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
from safetensors.torch import load, load_file

import ragckpt
from ragckpt.convert import hf_export
from ragckpt.convert.hf_export import export_hf
from ragckpt.errors import IntegrityError
from tests.helpers import assert_bit_equal, special_tensor

REPO = Path(__file__).resolve().parents[2]
INDEX = "model.safetensors.index.json"
SHAPE = (64, 64)  # float32: 16 KiB a tensor
SHARD3 = 2 * 64 * 64 * 4 + 1000  # two tensors a shard: 6 tensors -> 3 shards
SHARD2 = 3 * 64 * 64 * 4 + 1000  # three tensors a shard: 6 tensors -> 2 shards


def _state(seed: int) -> dict[str, torch.Tensor]:
    return {f"model.layers.{i}.weight": special_tensor(SHAPE, torch.float32, seed=seed + i) for i in range(6)}


@pytest.fixture
def models(tmp_path):
    """Checkpoints A and B of the same model (same names, other bytes)."""
    a, b = _state(0), _state(100)
    ragckpt.write_global(a, str(tmp_path / "A"), 2)
    ragckpt.write_global(b, str(tmp_path / "B"), 2)
    return str(tmp_path / "A"), a, str(tmp_path / "B"), b


def _temps(d) -> list[str]:
    return [n for n in os.listdir(d) if n.endswith(".tmp")]


def _assert_model(files: dict[str, bytes], state: dict[str, torch.Tensor], nfiles: int) -> None:
    """`files` ({name: bytes} of the model files present) is exactly the export of `state`."""
    weights = sorted(n for n in files if n.endswith(".safetensors"))
    assert len(weights) == nfiles, sorted(files)
    if nfiles == 1:
        assert weights == ["model.safetensors"] and INDEX not in files
        weight_map = dict.fromkeys(load(files["model.safetensors"]), "model.safetensors")
    else:
        weight_map = json.loads(files[INDEX])["weight_map"]
        assert sorted(set(weight_map.values())) == weights
    assert sorted(weight_map) == sorted(state)
    for f in weights:
        got = load(files[f])
        assert sorted(got) == sorted(n for n, wf in weight_map.items() if wf == f), f
        for n, t in got.items():
            assert_bit_equal(t, state[n], f"{f}:{n}")


def _assert_local_model(d, state, nfiles: int) -> None:
    names = [n for n in os.listdir(d) if n.endswith(".safetensors") or n == INDEX]
    files = {n: (Path(d) / n).read_bytes() for n in names}
    _assert_model(files, state, nfiles)
    for n in names:
        if n.endswith(".safetensors"):  # the file as a reader opens it
            for k, t in load_file(os.path.join(d, n)).items():
                assert_bit_equal(t, state[k], k)
    assert _temps(d) == []


def _fail_last_read(monkeypatch) -> list:
    """Make the read of the export's last task (the last shard's data) raise, after every earlier
    task (and so every earlier shard) is done. Returns a list that records the failure."""
    hits: list = []
    real_tasks = hf_export._read_tasks
    real_read, real_pieces = ragckpt.Checkpoint.read_rank_ranges, ragckpt.Checkpoint.read_pieces
    last: list = []

    def read_tasks(*a, **k):
        tasks = real_tasks(*a, **k)
        last[:] = [list(tasks[-1].reqs)]
        return tasks

    def fail_if_last(buffer, spans) -> None:
        if last and list(spans) == last[0]:
            hits.append(buffer)
            raise IntegrityError("injected: corrupt object")

    def read(self, buffer, reqs):  # remote outputs
        fail_if_last(buffer, reqs)
        return real_read(self, buffer, reqs)

    def pieces(self, buffer, reqs, partial):  # local outputs
        fail_if_last(buffer, [(r, a, a + sum(len(v) for v in views)) for r, a, views in reqs])
        return real_pieces(self, buffer, reqs, partial)

    monkeypatch.setattr(hf_export, "_read_tasks", read_tasks)
    monkeypatch.setattr(ragckpt.Checkpoint, "read_rank_ranges", read)
    monkeypatch.setattr(ragckpt.Checkpoint, "read_pieces", pieces)
    return hits


def _corrupt_rank_objects(ck_dir: str, rank: int) -> None:
    """Flip the tail bytes of every data object of `rank`: reading them fails its checksum."""
    n = 0
    for root, _, files in os.walk(ck_dir):
        for f in files:
            if f.startswith(f"c.{rank}."):
                p = os.path.join(root, f)
                with open(p, "r+b") as fh:
                    fh.seek(os.path.getsize(p) - 8)
                    fh.write(b"\xff" * 8)
                n += 1
    assert n


def test_failure_half_way_keeps_old_sharded_model(models, tmp_path, monkeypatch):
    a_dir, a, b_dir, b = models
    out = str(tmp_path / "hf")
    export_hf(a_dir, out, max_shard_size=SHARD3)
    _assert_local_model(out, a, 3)

    with monkeypatch.context() as m:
        hits = _fail_last_read(m)
        with pytest.raises(IntegrityError, match="injected"):
            export_hf(b_dir, out, max_shard_size=SHARD3, overwrite=True)
        assert hits
    # shards 1 and 2 of B were complete: none of them replaced A's
    _assert_local_model(out, a, 3)

    export_hf(b_dir, out, max_shard_size=SHARD3, overwrite=True)
    _assert_local_model(out, b, 3)


def test_corrupt_checkpoint_keeps_old_model(models, tmp_path):
    """A real IntegrityError (a corrupt object of B, rank 1 = the last layers) while replacing a
    sharded model: the old model stays, shards and index."""
    a_dir, a, b_dir, b = models
    out = str(tmp_path / "hf")
    export_hf(a_dir, out, max_shard_size=SHARD3)
    _corrupt_rank_objects(b_dir, 1)
    with pytest.raises(IntegrityError):
        export_hf(b_dir, out, max_shard_size=SHARD3, overwrite=True)
    _assert_local_model(out, a, 3)


def test_single_file_replacement_and_leftover_temp(models, tmp_path, monkeypatch):
    """One `model.safetensors` replaced by another: a failed export keeps the old file; a leftover
    temporary of a killed single-file export is removed by the next export."""
    a_dir, a, b_dir, b = models
    out = tmp_path / "hf"
    export_hf(a_dir, str(out))
    _assert_local_model(out, a, 1)
    leftover = out / f".model.safetensors.{uuid.uuid4().hex}.tmp"
    leftover.write_bytes(b"\0" * 4096)  # what a SIGKILLed export leaves

    with monkeypatch.context() as m:
        hits = _fail_last_read(m)
        with pytest.raises(IntegrityError, match="injected"):
            export_hf(b_dir, str(out), overwrite=True)
        assert hits
    _assert_local_model(out, a, 1)  # no temporary left either

    export_hf(b_dir, str(out), overwrite=True)
    _assert_local_model(out, b, 1)


def test_killed_export_keeps_old_model_and_next_run_cleans_up(models, tmp_path):
    a_dir, a, b_dir, b = models
    out = str(tmp_path / "hf")
    export_hf(a_dir, out, max_shard_size=SHARD3)
    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("needs /proc to find which file a write goes to")
    # SIGKILL the export on its first data write into the last shard
    child = f"""
import os, signal, sys
sys.path.insert(0, {str(REPO)!r})
from ragckpt.convert.hf_export import export_hf
real = os.pwrite
def pwrite(fd, data, offset):
    if offset > 0 and "model-00003-of-00003" in os.readlink(f"/proc/self/fd/{{fd}}"):
        os.kill(os.getpid(), signal.SIGKILL)
    return real(fd, data, offset)
os.pwrite = pwrite
export_hf({b_dir!r}, {out!r}, max_shard_size={SHARD3}, overwrite=True, workers=1)
"""
    p = subprocess.run([sys.executable, "-c", child], cwd=str(REPO), capture_output=True, timeout=300)
    assert p.returncode == -signal.SIGKILL, p.stderr.decode()[-2000:]
    assert _temps(out)  # the killed run's temporaries, full shard size
    assert sorted(n for n in os.listdir(out) if not n.startswith(".")) == [
        "model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors", "model-00003-of-00003.safetensors",
        INDEX]
    names = [n for n in os.listdir(out) if not n.startswith(".")]
    _assert_model({n: Path(out, n).read_bytes() for n in names}, a, 3)  # still exactly A

    export_hf(b_dir, out, max_shard_size=SHARD3, overwrite=True)
    _assert_local_model(out, b, 3)  # and the temporaries are gone


def test_only_this_tools_temporaries_are_removed(models, tmp_path):
    a_dir, a, b_dir, b = models
    out = tmp_path / "hf"
    export_hf(a_dir, str(out), max_shard_size=SHARD3)
    h = uuid.uuid4().hex
    ours = [f".model-00002-of-00003.safetensors.{h}.tmp", f".model.safetensors.{h}.tmp", f".{INDEX}.{h}.tmp",
            f".config.json.{h}.tmp"]
    users = [".model.safetensors.tmp", f".model.safetensors.{h[:31]}.tmp", f".model.safetensors.{h.upper()}.tmp",
             f".model.safetensors.{h}.tmp.bak", f"model.safetensors.{h}.tmp", f".adapter_model.safetensors.{h}.tmp",
             f".model-1-of-3.safetensors.{h}.tmp", "adapter_model.safetensors", "notes.tmp", "config.json"]
    for n in ours:
        (out / n).write_bytes(b"leftover")
    for n in users:
        (out / n).write_bytes(f"user {n}".encode())
    (out / f".model-00001-of-00003.safetensors.{uuid.uuid4().hex}.tmp").mkdir()  # not a file: kept
    (out / "sub").mkdir()
    (out / "sub" / f".model.safetensors.{h}.tmp").write_bytes(b"user")  # not in OUT_DIR itself

    export_hf(b_dir, str(out), max_shard_size=SHARD3, overwrite=True)
    for n in ours:
        assert not (out / n).exists(), n
    for n in users:
        assert (out / n).read_bytes() == f"user {n}".encode(), n
    assert (out / "sub" / f".model.safetensors.{h}.tmp").read_bytes() == b"user"
    assert len([n for n in os.listdir(out) if n.endswith(".tmp") and (out / n).is_dir()]) == 1
    names = [n for n in os.listdir(out) if n.endswith(".safetensors") and n != "adapter_model.safetensors"
             or n == INDEX]
    _assert_model({n: (out / n).read_bytes() for n in names}, b, 3)


def test_refused_export_touches_nothing(models, tmp_path):
    """Without --overwrite an export into a model directory is refused before it changes anything,
    leftover temporaries included."""
    a_dir, a, b_dir, _ = models
    out = tmp_path / "hf"
    export_hf(a_dir, str(out))
    leftover = out / f".model.safetensors.{uuid.uuid4().hex}.tmp"
    leftover.write_bytes(b"x")
    with pytest.raises(ragckpt.DestinationExistsError):
        export_hf(b_dir, str(out))
    assert leftover.read_bytes() == b"x"


def _s3_files(fs, d: str) -> dict[str, bytes]:
    fs.invalidate_cache()
    return {p.rsplit("/", 1)[1]: fs.cat_file(p) for p in fs.ls(d, detail=False)
            if p.endswith(".safetensors") or p.endswith(INDEX)}


def test_s3_failure_never_leaves_a_loadable_mix(models, s3, monkeypatch):
    """On object storage an upload is visible once complete, so new shards that take old shards'
    names go after the old index is removed: a failure leaves no index (nothing loads), never a mix."""
    url, opts = s3
    fs = s3.fs()
    a_dir, a, b_dir, b = models
    out = f"{url}/hf"
    export_hf(a_dir, out, max_shard_size=SHARD3, storage_options=opts)
    _assert_model(_s3_files(fs, out), a, 3)

    with monkeypatch.context() as m:
        hits = _fail_last_read(m)
        with pytest.raises(IntegrityError, match="injected"):
            export_hf(b_dir, out, max_shard_size=SHARD3, overwrite=True, storage_options=opts)
        assert hits
    left = _s3_files(fs, out)
    assert INDEX not in left and "model.safetensors" not in left, sorted(left)

    export_hf(b_dir, out, max_shard_size=SHARD3, overwrite=True, storage_options=opts)
    _assert_model(_s3_files(fs, out), b, 3)


def test_s3_failure_with_new_shard_names_keeps_old_model(models, s3, monkeypatch):
    """New shard names (3 shards -> 2) never replace an old file: the new index is the switch, so a
    failure before it keeps the old model whole."""
    url, opts = s3
    fs = s3.fs()
    a_dir, a, b_dir, b = models
    out = f"{url}/hf"
    export_hf(a_dir, out, max_shard_size=SHARD3, storage_options=opts)
    with monkeypatch.context() as m:
        _fail_last_read(m)
        with pytest.raises(IntegrityError, match="injected"):
            export_hf(b_dir, out, max_shard_size=SHARD2, overwrite=True, storage_options=opts)
    _assert_model(_s3_files(fs, out), a, 3)
    export_hf(b_dir, out, max_shard_size=SHARD2, overwrite=True, storage_options=opts)
    _assert_model(_s3_files(fs, out), b, 2)

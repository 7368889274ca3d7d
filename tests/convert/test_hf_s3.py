"""import-hf from and export-hf to object storage (moto's real S3 HTTP server): the same bytes as
the local path, a sharded model read by byte ranges, and a sharded export written in order."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load, save

import ragckpt
from cli.main import cli
from ragckpt.convert.hf_export import export_hf
from ragckpt.convert.hf_import import import_hf
from tests.helpers import bits, cli_error, special_tensor


def test_hf_roundtrip_through_s3(s3, tmp_path):
    url, opts = s3
    fs = s3.fs()
    state = {f"model.layers.{i}.w": special_tensor((96, 64), dt, seed=i)
             for i, dt in enumerate([torch.bfloat16, torch.float32, torch.float8_e5m2, torch.int8, torch.float16])}
    names = list(state)
    files = {"model-00001-of-00002.safetensors": names[:3], "model-00002-of-00002.safetensors": names[3:]}
    for f, ns in files.items():
        fs.pipe_file(f"{url}/hf/{f}", save({n: state[n] for n in ns}, metadata={"format": "pt"}))
    fs.pipe_file(f"{url}/hf/model.safetensors.index.json",
                 json.dumps({"weight_map": {n: f for f, ns in files.items() for n in ns}}).encode())
    fs.pipe_file(f"{url}/hf/config.json", b'{"model_type": "toy"}')

    res = import_hf(f"{url}/hf", f"{url}/ck", 3, storage_options=opts)
    assert len(res.files) == 2 and res.tensors == 5
    ck = ragckpt.open(f"{url}/ck", storage_options=opts)
    assert ck.world_size == 3 and ck.user["hf"]["config"] == {"model_type": "toy"}

    out = export_hf(f"{url}/ck", f"{url}/out", max_shard_size=30000, storage_options=opts)
    assert len(out.files) > 1 and out.wrote_config
    index = json.loads(fs.cat_file(f"{url}/out/model.safetensors.index.json"))
    got = {}
    for f in out.files:
        part = load(fs.cat_file(f"{url}/out/{f}"))
        assert all(index["weight_map"][k] == f for k in part)
        got.update(part)
    assert set(got) == set(state)
    for k, v in state.items():
        assert got[k].dtype == v.dtype and torch.equal(bits(got[k]), bits(v)), k

    # the CLI with -o flags: from S3 to a local directory; existing S3 weights are refused
    r = CliRunner().invoke(cli, ["export-hf", f"{url}/ck", str(tmp_path / "local"), *s3.cli_args(), "--json"])
    assert r.exit_code == 0, r.stderr
    r = CliRunner().invoke(cli, ["export-hf", f"{url}/ck", f"{url}/out", *s3.cli_args()])
    assert r.exit_code == 2 and "already holds model weights" in r.stderr


def test_export_hf_storage_problems_are_one_line_naming_the_url(s3, tmp_path):
    """A missing bucket, an option the client rejects, a backend that is not installed: exit 2 with
    the storage layer's line, never an internal error (exit 3) or a message naming nothing."""
    url, _ = s3
    ck = str(tmp_path / "ck")
    ragckpt.write_global({"model.w": torch.ones(4, 4)}, ck, world_size=2)
    line = cli_error("export-hf", ck, "s3://no-such-bucket-here/hf", *s3.cli_args())
    assert "s3://no-such-bucket-here" in line and "bucket 'no-such-bucket-here' does not exist" in line
    line = cli_error("export-hf", ck, f"{url}/hf", *s3.cli_args(), "-o", "foo=bar")
    assert url.split("://")[0] in line and "foo" in line
    line = cli_error("export-hf", ck, "gs://bucket/hf")
    assert "gs://bucket/hf" in line and "internal error" not in line


def test_export_hf_refuses_a_directory_holding_a_checkpoint(s3, tmp_path):
    """Exporting into another ragckpt checkpoint would scatter model files among its objects (only
    SRC itself used to be refused); an overwrite does not make that right either."""

    url, opts = s3
    src, other = str(tmp_path / "src"), str(tmp_path / "other")
    for u in (src, other):
        ragckpt.write_global({"model.w": torch.ones(4, 4)}, u, world_size=2)
    before = sorted(p.name for p in (tmp_path / "other").rglob("*"))
    for flags in ((), ("--overwrite",)):
        line = cli_error("export-hf", src, other, *flags)
        assert f"{other} holds a ragckpt checkpoint" in line
    assert sorted(p.name for p in (tmp_path / "other").rglob("*")) == before
    ragckpt.write_global({"model.w": torch.ones(4, 4)}, f"{url}/other", world_size=2, storage_options=opts)
    line = cli_error("export-hf", src, f"{url}/other", *s3.cli_args())
    assert "holds a ragckpt checkpoint" in line


def test_export_hf_refuses_an_out_dir_fsspec_would_parse_elsewhere(s3, tmp_path):
    """'?versionId=' is a version to s3fs and '::' a chain of URLs: an export to
    s3://b/models?versionId=1/out wrote its files over the user's object 'models', and reported success."""

    url, opts = s3
    ck = str(tmp_path / "ck")
    ragckpt.write_global({"model.w": torch.ones(4, 4)}, ck, world_size=2)
    fs = s3.fs()
    bucket_path = url.split("://", 1)[1]
    fs.pipe(f"{bucket_path}/models", b"the user's own object")
    before = {p: fs.info(p)["ETag"] for p in fs.find(bucket_path)}
    line = cli_error("export-hf", ck, f"{url}/models?versionId=1/out", *s3.cli_args())
    assert "export-hf cannot write under" in line and "would write to" in line and f"{bucket_path}/models'" in line
    line = cli_error("export-hf", ck, f"{url}/a::b/hf", *s3.cli_args())
    assert "export-hf cannot write under" in line and "'::'" in line
    assert {p: fs.info(p)["ETag"] for p in fs.find(bucket_path)} == before
    assert fs.cat(f"{bucket_path}/models") == b"the user's own object"


# -- streamed uploads ---------------------------------------------------------------------------------------

def test_export_hf_to_s3_writes_the_same_bytes_as_to_local_files_in_parts(s3, tmp_path):
    """With a small budget every file goes up as a multipart upload of 5 MiB parts, cast or not: the
    objects hold exactly the bytes the local export writes, and no upload is left open."""
    url, opts = s3
    fs = s3.fs()
    g = torch.Generator().manual_seed(3)
    state = {f"model.layers.{i}.w": torch.randint(-2**15, 2**15, (1024, 1500 + i), dtype=torch.int16, generator=g)
             .view(torch.bfloat16) for i in range(5)}  # 15 MiB of bf16, odd row lengths
    state["model.norm.b"] = torch.tensor([True, False, True])  # a 3-byte tensor between wide ones
    ck = str(tmp_path / "ck")
    ragckpt.write_global(state, ck, world_size=3)
    for dtype, shard in (("keep", "8MB"), ("fp32", "5GB")):
        local = export_hf(ck, str(tmp_path / f"local-{dtype}"), dtype=dtype, max_shard_size=shard,
                          memory_bytes=16 << 20)
        remote = export_hf(ck, f"{url}/{dtype}", dtype=dtype, max_shard_size=shard, memory_bytes=16 << 20,
                           storage_options=opts)
        assert remote.files == local.files
        multipart = 0
        for f in local.files:
            want = (tmp_path / f"local-{dtype}" / f).read_bytes()
            assert fs.cat_file(f"{url}/{dtype}/{f}") == want, (dtype, f)
            multipart += "-" in fs.info(f"{url}/{dtype}/{f}")["ETag"]
        assert multipart >= 1, dtype
    assert not fs.call_s3("list_multipart_uploads", Bucket=s3.bucket).get("Uploads")


_S3_MEMORY_PROBE = """
import json, sys
import torch  # imports are not data: the export loads torch on first use (ragckpt.lazy)
from ragckpt.convert.hf_export import export_hf
from ragckpt.storage.store import open_store
def status(key):  # VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the forking parent
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key + ":"))
src, dst, dtype, opts = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
probe = open_store(dst + "-probe", opts)  # the S3 client loaded and used once: not the export's memory
probe.write("x", [b"x" * 1000])
probe.read_range("x", 0, 10)
base = status("VmRSS")
export_hf(src, dst, memory_bytes=32 << 20, workers=4, dtype=dtype, storage_options=opts)
print(json.dumps({"above": status("VmHWM") - base}))
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc for RSS")
def test_export_hf_to_s3_memory_does_not_grow_with_the_file(s3, tmp_path):
    """A 192 MiB model file (and a 192 MiB fp32 cast of a 96 MiB one) exported to S3 with a 32 MiB
    budget: the process peaks well under the file's size. Through fsspec's buffered writer it peaked
    192-210 MiB above the start for the first and 262-302 MiB for the cast."""
    url, opts = s3
    g = torch.Generator().manual_seed(0)
    state = {f"model.layers.{i}.w": torch.randint(-2**15, 2**15, (2048, 4096), dtype=torch.int16, generator=g)
             .view(torch.bfloat16) for i in range(12)}
    size = sum(t.numel() * t.element_size() for t in state.values())
    ck_big, ck_half = str(tmp_path / "big"), str(tmp_path / "half")
    ragckpt.write_global(state, ck_big, world_size=4)
    ragckpt.write_global(dict(list(state.items())[:6]), ck_half, world_size=4)
    del state
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for src, dtype, out in ((ck_big, "keep", "keep"), (ck_half, "fp32", "cast")):
        p = subprocess.run([sys.executable, "-c", _S3_MEMORY_PROBE, src, f"{url}/{out}", dtype, json.dumps(opts)],
                           capture_output=True, text=True, cwd=repo, timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
        above = json.loads(p.stdout.strip().splitlines()[-1])["above"]
        # measured 49 and 57 MiB: the 32 MiB budget plus the HTTP client's own buffers
        assert above < 72 << 20 and above < size / 2.5, (out, above >> 20)
    fs = s3.fs()
    assert fs.info(f"{url}/keep/model.safetensors")["size"] > size
    assert fs.info(f"{url}/cast/model.safetensors")["size"] > size


def test_export_hf_to_s3_with_a_doubled_slash_lists_and_replaces_where_it_writes(s3, tmp_path):
    """The store reads s3://b//p as prefix 'p', while fsspec's listing of 'b//p' looked under key '/p':
    a second export saw no weights there, was not refused without --overwrite, and left the first
    export's shards beside its own."""
    url, opts = s3
    fs = s3.fs()
    bucket = url.split("://", 1)[1].split("/")[0]
    ck = str(tmp_path / "ck")
    state = {f"model.layers.{i}.w": special_tensor((64, 64), torch.float32, seed=i) for i in range(3)}
    ragckpt.write_global(state, ck, world_size=2)
    doubled = f"s3://{bucket}//dbl"
    first = export_hf(ck, doubled, max_shard_size=20000, storage_options=opts, write_config=False)
    assert len(first.files) == 3
    assert sorted(p.rsplit("/", 1)[1] for p in fs.ls(f"{bucket}/dbl")) == sorted(
        [*first.files, "model.safetensors.index.json"])
    line = cli_error("export-hf", ck, doubled, *s3.cli_args())
    assert "already holds model weights" in line
    fs.invalidate_cache()
    again = export_hf(ck, doubled, overwrite=True, storage_options=opts, write_config=False)
    assert again.files == ["model.safetensors"]
    fs.invalidate_cache()
    assert [p.rsplit("/", 1)[1] for p in fs.ls(f"{bucket}/dbl")] == ["model.safetensors"]
    got = load(fs.cat_file(f"{bucket}/dbl/model.safetensors"))
    assert set(got) == set(state) and all(torch.equal(bits(got[k]), bits(v)) for k, v in state.items())


def test_export_hf_to_an_fsspec_memory_url(tmp_path):
    """memory://name/out is fsspec's '/name/out': the '?'/'::' guard compared it with 'name/out' and
    refused it as a URL fsspec would parse elsewhere."""
    import fsspec

    ck = str(tmp_path / "ck")
    state = {"model.w": special_tensor((33, 7), torch.bfloat16, seed=5), "model.n": torch.tensor([True, False])}
    ragckpt.write_global(state, ck, world_size=3)
    root = f"mem-export-{os.getpid()}"
    fs = fsspec.filesystem("memory")
    try:
        res = export_hf(ck, f"memory://{root}/out", write_config=False)
        assert res.files == ["model.safetensors"]
        assert fs.ls(f"/{root}/out", detail=False) == [f"/{root}/out/model.safetensors"]
        local = export_hf(ck, str(tmp_path / "hf"), write_config=False)
        assert fs.cat_file(f"/{root}/out/model.safetensors") == (tmp_path / "hf" / local.files[0]).read_bytes()
    finally:
        if fs.exists(f"/{root}"):
            fs.rm(f"/{root}", recursive=True)

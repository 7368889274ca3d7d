"""import-hf from and export-hf to object storage (moto's real S3 HTTP server): the same bytes as
the local path, a sharded model read by byte ranges, and a sharded export written in order."""

from __future__ import annotations

import json

import torch
from click.testing import CliRunner
from safetensors.torch import load, save

import ragckpt
from cli.main import cli
from ragckpt.convert.hf_export import export_hf
from ragckpt.convert.hf_import import import_hf
from tests.helpers import bits, special_tensor


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
    from tests.helpers import cli_error

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
    from tests.helpers import cli_error

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
    from tests.helpers import cli_error

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

"""`ragckpt info`, `verify` and `ls` on s3:// URLs, with the endpoint given as `-o` flags."""

from __future__ import annotations

import json

import torch
from click.testing import CliRunner

import ragckpt
from cli.main import cli
from ragckpt.checkpoint.writer import write_streaming
from tests.helpers import special_tensor


def _run(*args: str) -> tuple[int, str, str]:
    r = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    return r.exit_code, r.stdout, r.stderr


def _save(url: str, opts: dict) -> dict[str, torch.Tensor]:
    state = {"layer.w": special_tensor((40, 30), torch.float32, 1), "layer.b": special_tensor((30,), torch.bfloat16, 2)}
    ragckpt.write_global(state, url, 4, storage_options=opts, user={"step": 12})
    return state


def test_info_verify_ls_on_s3(s3):
    url, opts = s3
    _save(f"{url}/step_12", opts)
    o = s3.cli_args()
    code, out, err = _run("info", f"{url}/step_12", *o, "--json")
    assert code == 0, err
    s = json.loads(out)
    assert s["url"] == f"{url}/step_12" and s["committed"] and s["world_size"] == 4 and s["user"] == {"step": 12}
    code, out, err = _run("verify", f"{url}/step_12", *o)
    assert code == 0, err
    assert out.startswith("OK:")
    code, out, err = _run("ls", f"{url}/step_12", *o)
    assert code == 0 and sorted(out.split()) == ["layer.b", "layer.w"]


def test_ls_prefix_shows_committed_and_incomplete_checkpoints(s3):
    url, opts = s3
    _save(f"{url}/step_1", opts)
    lay = ragckpt.CheckpointLayout.build({"w": ((8,), "float32")}, 1, "row")
    raw = torch.arange(8, dtype=torch.float32).view(torch.uint8).numpy().data
    write_streaming(f"{url}/step_2", lay, lambda bi, r: (lambda lo, hi: raw[lo * 4 : hi * 4]),
                    storage_options=opts, do_commit=False)
    code, out, err = _run("ls", url, *s3.cli_args(), "--json")
    assert code == 0, err
    assert json.loads(out) == [{"url": f"{url}/step_1", "committed": True},
                               {"url": f"{url}/step_2", "committed": False}]
    code, out, err = _run("info", f"{url}/step_2", *s3.cli_args())
    assert code == 0 and "NOT COMMITTED" in out
    code, out, err = _run("verify", f"{url}/step_2", *s3.cli_args())
    assert code == 2 and f"{url}/step_2 is not committed" in err


def test_verify_names_a_corrupt_object_on_s3(s3):
    url, opts = s3
    _save(f"{url}/ck", opts)
    fs = s3.fs()
    victim = sorted(k for k in fs.find(f"{url}/ck/buffers") if "/c." in k)[0]
    data = bytearray(fs.cat_file(victim))
    data[len(data) // 2] ^= 0xFF
    fs.pipe_file(victim, bytes(data))
    code, out, err = _run("verify", f"{url}/ck", *s3.cli_args())
    assert code == 1
    assert f"s3://{victim}" in err and "checksum mismatch" in err


def test_storage_errors_are_one_line_with_the_url(s3):
    code, out, err = _run("info", "s3://no-such-bucket-cli/ck", *s3.cli_args())
    assert code == 2
    assert err.strip().count("\n") == 0 and "no-such-bucket-cli" in err and "Traceback" not in err
    code, out, err = _run("info", f"{s3.url}/none", *s3.cli_args())
    assert code == 2 and f"no ragckpt checkpoint at {s3.url}/none" in err
    # ls names the missing bucket, not a listing of URL/ranks the user never typed
    code, out, err = _run("ls", "s3://no-such-bucket-cli/x", *s3.cli_args())
    assert code == 2 and "bucket 'no-such-bucket-cli' does not exist" in err and "/ranks" not in err, err
    code, out, err = _run("info", f"{s3.url}/none", *s3.cli_args(), "-o", "ragckpt.concurency=3")
    assert code == 2 and "unknown storage option 'ragckpt.concurency'" in err


def test_verify_sizes_chunks_from_the_listing_not_a_head_each(s3, monkeypatch):
    from ragckpt.storage.remote import S3Store

    url, opts = s3
    ragckpt.write_global({"w": special_tensor((64, 8), torch.float32, 3)}, f"{url}/ck", 16, "row",
                         storage_options=opts)
    heads = []
    real = S3Store._head

    async def counting_head(self, key):
        heads.append(key)
        return await real(self, key)

    monkeypatch.setattr(S3Store, "_head", counting_head)
    rep = ragckpt.open(f"{url}/ck", storage_options=opts).verify()
    assert rep.ok and rep.objects > 16
    assert not [k for k in heads if k.startswith("buffers/")], heads
    # a missing and a truncated chunk object are still named
    fs = s3.fs()
    chunks = sorted(k for k in fs.find(f"{url}/ck/buffers") if "/c." in k)
    fs.rm(chunks[0])
    fs.pipe_file(chunks[1], fs.cat_file(chunks[1])[:-4])
    problems = ragckpt.open(f"{url}/ck", storage_options=opts).verify().problems
    assert any(f"object s3://{chunks[0]} is missing" in p for p in problems), problems
    assert any(f"s3://{chunks[1]}: " in p and "bytes, expected" in p for p in problems), problems

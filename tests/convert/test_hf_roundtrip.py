"""Hugging Face round trip with the real clients on both ends: a `transformers` Llama saved with
`save_pretrained`, imported for 4 ranks, resharded to 3, exported, and loaded back with
`from_pretrained`. Weights and logits must be identical, and the exported files must satisfy
safetensors' own loader (metadata, index, file modes)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from click.testing import CliRunner

import ragckpt
from cli.main import cli
from ragckpt.convert.hf_export import export_hf
from ragckpt.convert.hf_import import import_hf

transformers = pytest.importorskip("transformers")
from safetensors import safe_open  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from tests.helpers import bits  # noqa: E402


def tiny_llama(dtype: torch.dtype) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256)
    model = LlamaForCausalLM(cfg).to(dtype).eval()
    with torch.no_grad():  # give norms non-trivial values so a swapped tensor would show
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(1 + 0.1 * torch.randn_like(p))
    return model


def run_cli(*args: str) -> str:
    res = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return res.stdout


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_llama_import_reshard_export(tmp_path, dtype):
    model = tiny_llama(dtype)
    src = tmp_path / "hf_src"
    model.save_pretrained(src, max_shard_size="60KB")  # several shards + model.safetensors.index.json
    assert (src / "model.safetensors.index.json").exists()

    # import through the CLI for 4 ranks, as a user would
    out = json.loads(run_cli("import-hf", str(src), str(tmp_path / "w4"), "--world-size", "4", "--json"))
    assert out["world_size"] == 4 and out["tensors"] == len(model.state_dict())
    ck4 = ragckpt.open(str(tmp_path / "w4"))
    assert ck4.world_size == 4 and ck4.verify().ok
    # the weights really are spread over the 4 ranks
    owners = {int(r) for n in ck4.names() for r, u in enumerate(ck4.meta(n).placement.local_units) if u}
    assert owners == {0, 1, 2, 3}

    ragckpt.reshard.reshard(str(tmp_path / "w4"), str(tmp_path / "w3"), 3)
    ck3 = ragckpt.open(str(tmp_path / "w3"))
    assert ck3.world_size == 3

    dst = tmp_path / "hf_out"
    out = json.loads(run_cli("export-hf", str(tmp_path / "w3"), str(dst), "--max-shard-size", "100KB", "--json"))
    files = sorted(f for f in os.listdir(dst) if f.endswith(".safetensors"))
    assert len(files) > 1 and files == out["files"]
    assert all(f"-of-{len(files):05d}.safetensors" in f for f in files)
    # config.json recorded at import travelled through the reshard and was written back
    assert out["wrote_config"] and (dst / "config.json").exists()

    # independent reader 1: safetensors itself, file by file
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    total = 0
    for f in files:
        assert os.stat(dst / f).st_mode & 0o777 == 0o644
        with safe_open(dst / f, "pt") as h:
            assert h.metadata() == {"format": "pt"}
            for k in h.keys():
                assert index["weight_map"][k] == f
                t = h.get_tensor(k)
                total += t.numel() * t.element_size()
    assert index["metadata"]["total_size"] == total
    assert set(index["weight_map"]) == set(model.state_dict())

    # independent reader 2: transformers
    loaded = LlamaForCausalLM.from_pretrained(dst, dtype=dtype).eval()
    ref, got = model.state_dict(), loaded.state_dict()
    assert ref.keys() == got.keys()
    for k in ref:
        assert got[k].dtype == dtype and torch.equal(bits(got[k]), bits(ref[k])), k
    # logits against the same model loaded by transformers from the original directory (a model
    # built in fp32 and cast with .to() also casts non-persistent buffers such as rotary inv_freq,
    # which from_pretrained keeps in fp32; loading both sides the same way isolates the weights)
    original = LlamaForCausalLM.from_pretrained(src, dtype=dtype).eval()
    x = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(original(x).logits, loaded(x).logits)


def test_import_records_config_and_export_writes_it(tmp_path):
    """A checkpoint imported from a model directory keeps its config.json, so an export straight
    from it is a complete `from_pretrained` directory."""
    model = tiny_llama(torch.float32)
    model.save_pretrained(tmp_path / "src")  # small: a single model.safetensors
    res = import_hf(str(tmp_path / "src"), str(tmp_path / "ck"), 2, layout="row")
    assert res.files[0].endswith("model.safetensors") and len(res.files) == 1
    out = export_hf(str(tmp_path / "ck"), str(tmp_path / "out"))
    assert out.files == ["model.safetensors"] and out.wrote_config
    assert not (tmp_path / "out" / "model.safetensors.index.json").exists()
    loaded = LlamaForCausalLM.from_pretrained(tmp_path / "out").eval()
    x = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(model(x).logits, loaded(x).logits)


def test_export_cast_to_bf16_matches_torch(tmp_path):
    """--dtype bf16 on an fp32 model gives exactly what `model.to(torch.bfloat16)` gives."""
    model = tiny_llama(torch.float32)
    model.save_pretrained(tmp_path / "src")
    import_hf(str(tmp_path / "src"), str(tmp_path / "ck"), 3)
    run_cli("export-hf", str(tmp_path / "ck"), str(tmp_path / "out"), "--dtype", "bf16")
    loaded = LlamaForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.bfloat16)
    ref = model.to(torch.bfloat16).state_dict()
    for k, v in loaded.state_dict().items():
        assert v.dtype == torch.bfloat16 and torch.equal(bits(v), bits(ref[k])), k


def test_cast_export_config_says_the_exported_dtype(tmp_path):
    model = tiny_llama(torch.float32)
    src = tmp_path / "hf_src"
    model.save_pretrained(src)
    cfg_in = json.loads((src / "config.json").read_text())
    keys = [k for k in ("torch_dtype", "dtype") if k in cfg_in]
    assert keys and all(cfg_in[k] == "float32" for k in keys)
    run_cli("import-hf", str(src), str(tmp_path / "ck"), "--world-size", "2")
    run_cli("export-hf", str(tmp_path / "ck"), str(tmp_path / "out"), "--dtype", "bf16")
    cfg_out = json.loads((tmp_path / "out" / "config.json").read_text())
    assert all(cfg_out[k] == "bfloat16" for k in keys)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert loaded.dtype == torch.bfloat16


def test_training_checkpoint_export_takes_the_config_from_the_user(tmp_path):
    """A checkpoint a training job wrote records no config.json: the export says so instead of
    leaving a directory from_pretrained would fill with a default (7B) config; `--config` supplies
    it, and with a cast and no dtype key in it, the written config still names the exported dtype."""
    model = tiny_llama(torch.float32)
    ragckpt.write_global(dict(model.state_dict()), str(tmp_path / "ck"), 3)
    res = CliRunner().invoke(cli, ["export-hf", str(tmp_path / "ck"), str(tmp_path / "bare")])
    assert res.exit_code == 0 and "OUT_DIR has no config.json" in res.stdout, res.output
    assert not (tmp_path / "bare" / "config.json").exists()

    cfg = model.config.to_dict()
    for k in ("dtype", "torch_dtype"):
        cfg.pop(k, None)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    out = run_cli("export-hf", str(tmp_path / "ck"), str(tmp_path / "out"), "--dtype", "bf16",
                  "--config", str(tmp_path / "config.json"))
    assert "wrote config.json" in out and "no config.json" not in out
    assert json.loads((tmp_path / "out" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    loaded = LlamaForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert loaded.dtype == torch.bfloat16
    ref = model.to(torch.bfloat16).state_dict()
    for k, v in loaded.state_dict().items():
        assert torch.equal(bits(v), bits(ref[k])), k

    # a job that records its config at save gets it written back without --config
    ragckpt.write_global(dict(model.state_dict()), str(tmp_path / "ck2"), 2, user={"hf": {"config": cfg}})
    assert run_cli("export-hf", str(tmp_path / "ck2"), str(tmp_path / "out2")).count("wrote config.json") == 1
    assert json.loads((tmp_path / "out2" / "config.json").read_text()) == json.loads(json.dumps(cfg))

    # an existing config.json is replaced only with --overwrite; a config that is not JSON is refused
    res = CliRunner().invoke(cli, ["export-hf", str(tmp_path / "ck"), str(tmp_path / "cfg_only"),
                                   "--config", str(tmp_path / "config.json")])
    assert res.exit_code == 0, res.output
    (tmp_path / "cfg_only" / "model.safetensors").unlink()
    res = CliRunner().invoke(cli, ["export-hf", str(tmp_path / "ck"), str(tmp_path / "cfg_only"),
                                   "--config", str(tmp_path / "config.json")])
    assert res.exit_code != 0 and "already holds a config.json" in res.stderr, res.output
    (tmp_path / "bad.json").write_text("[1, 2]")
    res = CliRunner().invoke(cli, ["export-hf", str(tmp_path / "ck"), str(tmp_path / "o2"),
                                   "--config", str(tmp_path / "bad.json")])
    assert res.exit_code != 0 and "bad.json is not a JSON object" in res.stderr, res.output
    assert not (tmp_path / "o2").exists()

"""`ragfsdp.train` end to end: 2 torchrun ranks against a plain single-process torch loop of the same
model, data and optimizer (torch.optim.AdamW), auto-checkpointing and resume at another world size,
the HF export loaded by transformers, a token file read by position, and bad flags refused in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import ragckpt
from ragfsdp import data, models, train

REPO = Path(__file__).resolve().parents[2]
B, L = 4, 16
TORCH_ENV = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def _one_process(monkeypatch):
    for k in TORCH_ENV:
        monkeypatch.delenv(k, raising=False)


def torchrun(*args: str, nproc: int = 2) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "ragfsdp.train", *args]
    env = {k: v for k, v in os.environ.items() if k not in TORCH_ENV}
    env["OMP_NUM_THREADS"] = "1"
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def read_log(path: Path) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for row in rows:
        assert set(row) >= {"step", "loss", "tokens_per_s"} and ({"peak_rss_bytes", "peak_cuda_bytes"} & set(row))
        assert row["tokens_per_s"] > 0 and (row.get("peak_rss_bytes") or row.get("peak_cuda_bytes")) > 0
    return rows


def reference(name: str, steps: int, batches: list[torch.Tensor] | None = None,
              clip: float | None = None) -> tuple[list[float], torch.nn.Module, list[float]]:
    """One process, no engine: the whole global batch, torch.optim.AdamW with torch's defaults (and
    torch's clip_grad_norm_ when `clip`): (losses, trained model, gradient norms)."""
    norms = []
    model, _, vocab = models.build(name, 0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    source = data.open_source(None, vocab, L, 0)
    losses = []
    for s in range(steps):
        batch = batches[s] if batches else torch.stack([source.sample(s * B + i) for i in range(B)])
        x, y = batch[:, :-1], batch[:, 1:]
        logits = model(x) if isinstance(model, models.GPT) else model(input_ids=x).logits
        loss = F.cross_entropy(logits.reshape(-1, vocab), y.reshape(-1))
        loss.backward()
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model, norms


def test_two_ranks_match_a_plain_loop_resume_at_one_rank_and_export_hf(tmp_path, fast_dir, capsys):
    """One torchrun job of 2 ranks (checkpointing every step, keeping 1), then a second invocation that
    resumes at 1 rank and exports: the 4 losses are those of a single process with torch.optim.AdamW."""
    transformers = pytest.importorskip("transformers")
    root, hf = Path(fast_dir) / "ckpt", tmp_path / "hf"  # checkpoints on tmpfs: fsync costs nothing
    common = ["--model", "tiny-llama", "--batch-size", str(B), "--seq-len", str(L), "--ckpt-dir", str(root),
              "--ckpt-every", "1", "--keep-last", "1"]
    torchrun(*common, "--steps", "2", "--log-json", str(tmp_path / "a.jsonl"))
    rows = ragckpt.list_checkpoints(str(root))
    assert [(Path(r["url"]).name, r["committed"]) for r in rows] == [("step-2", True)]  # step-1 pruned
    ck = ragckpt.open(rows[0]["url"])
    assert ck.world_size == 2 and ck.user["step"] == 2 and ck.user["extra"]["data_position"] == 2 * B

    # the second invocation: one process, resharded at load time, data continues at sample 2 * B
    capsys.readouterr()
    assert train.main([*common, "--steps", "4", "--log-json", str(tmp_path / "b.jsonl"), "--no-async",
                       "--export-hf", str(hf)]) == 0
    err = capsys.readouterr().err
    assert "resumed step 2 from 2 ranks at 1 ranks" in err, err
    first, second = read_log(tmp_path / "a.jsonl"), read_log(tmp_path / "b.jsonl")
    assert [r["step"] for r in first + second] == [1, 2, 3, 4]
    want, ref_model, _ = reference("tiny-llama", 4)
    torch.testing.assert_close(torch.tensor([r["loss"] for r in first + second]), torch.tensor(want),
                               rtol=1e-5, atol=1e-5)

    loaded = transformers.LlamaForCausalLM.from_pretrained(str(hf))
    init, _, _ = models.build("tiny-llama", 0)
    got, ref, start = loaded.state_dict(), ref_model.state_dict(), init.state_dict()
    assert set(got) == set(ref)
    for name, t in ref.items():
        torch.testing.assert_close(got[name], t, rtol=0, atol=1e-5, msg=name)
    assert max((got[n] - start[n]).abs().max().item() for n in ref) > 1e-3  # the trained weights, not the init


def test_token_file_is_read_by_position_with_clipping(tmp_path):
    tokens = np.random.default_rng(0).integers(0, 512, size=300, dtype=np.int32)
    np.save(tmp_path / "tokens.npy", tokens)
    log = tmp_path / "log.jsonl"
    assert train.main(["--model", "gpt-small", "--steps", "2", "--batch-size", str(B), "--seq-len", str(L),
                       "--data", str(tmp_path / "tokens.npy"), "--log-json", str(log), "--grad-clip", "0.5"]) == 0
    # sample i: the L + 1 tokens from offset (i * L) mod (n - L), as data.py documents
    windows = [torch.from_numpy(tokens[(i * L) % (300 - L):][:L + 1].astype(np.int64)) for i in range(2 * B)]
    want, _, norms = reference("gpt-small", 2, [torch.stack(windows[s * B:(s + 1) * B]) for s in range(2)], clip=0.5)
    rows = read_log(log)
    torch.testing.assert_close(torch.tensor([r["loss"] for r in rows]), torch.tensor(want), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.tensor([r["grad_norm"] for r in rows]), torch.tensor(norms),
                               rtol=1e-5, atol=1e-5)
    # the same tokens as raw little-endian files (nanoGPT's uint16 .bin, or int32 with --data-dtype)
    tokens.astype("<u2").tofile(tmp_path / "tokens.bin")
    tokens.astype("<i4").tofile(tmp_path / "tokens32.bin")
    for path, dtype in (("tokens.bin", "uint16"), ("tokens32.bin", "int32")):
        raw = data.open_source(str(tmp_path / path), 512, L, 0, dtype)
        assert all(torch.equal(raw.sample(i), windows[i]) for i in range(2 * B))


def test_init_from_an_hf_import_takes_its_weights_and_a_fresh_optimizer(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    hf_model, _, _ = models.build("tiny-llama", 7)  # other weights than --seed 0 would draw
    hf_model.save_pretrained(str(tmp_path / "hf"))
    ragckpt.import_hf(str(tmp_path / "hf"), str(tmp_path / "imported"), world_size=2)
    capsys.readouterr()
    log = tmp_path / "log.jsonl"
    assert train.main(["--model", "tiny-llama", "--steps", "1", "--batch-size", str(B), "--seq-len", str(L),
                       "--init-from", str(tmp_path / "imported"), "--log-json", str(log)]) == 0
    err = capsys.readouterr().err
    assert "initialised the weights from" in err and "(2 ranks) at 1 ranks; the optimizer starts fresh" in err, err
    batch = torch.stack([data.open_source(None, 256, L, 0).sample(i) for i in range(B)])
    with torch.no_grad():
        want = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "hf"))(input_ids=batch[:, :-1]).logits
    want_loss = F.cross_entropy(want.reshape(-1, 256), batch[:, 1:].reshape(-1)).item()
    assert read_log(log)[0]["step"] == 1
    assert read_log(log)[0]["loss"] == pytest.approx(want_loss, rel=1e-5)


def test_a_config_json_with_tied_embeddings(tmp_path):
    """Any AutoModelForCausalLM config: GPT-2 ties its head to the embedding, which the root then owns."""
    pytest.importorskip("transformers")
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "gpt2", "vocab_size": 300, "n_embd": 32, "n_layer": 2, "n_head": 2,
                               "n_positions": 64, "bos_token_id": 0, "eos_token_id": 0}))
    log = tmp_path / "log.jsonl"
    assert train.main(["--model", str(cfg), "--steps", "2", "--batch-size", str(B), "--seq-len", str(L),
                       "--log-json", str(log)]) == 0
    want, _, _ = reference(str(cfg), 2)
    torch.testing.assert_close(torch.tensor([r["loss"] for r in read_log(log)]), torch.tensor(want),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("optimizer", ["muon", "adam8bit"])
def test_other_optimizers_take_their_flags_and_resume(optimizer, tmp_path, fast_dir):
    """The flags reach the optimizer (its saved hyperparameters say so) and a restart from step 1
    repeats step 2 of the uninterrupted run."""
    argv = ["--model", "tiny-llama", "--batch-size", str(B), "--seq-len", str(L), "--optimizer", optimizer,
            "--lr", "0.02", "--weight-decay", "0.05", "--ckpt-dir", str(Path(fast_dir) / "ck"), "--ckpt-every", "1"]
    assert train.main([*argv, "--steps", "2", "--log-json", str(tmp_path / "a.jsonl")]) == 0
    groups = ragckpt.open(str(Path(fast_dir) / "ck" / "step-2")).user["optim.param_groups"]
    up = groups["model.layers.0.mlp.up_proj.weight"]
    assert up["lr"] == 0.02 and up["weight_decay"] == 0.05
    ragckpt.remove_checkpoint(str(Path(fast_dir) / "ck" / "step-2"))
    assert train.main([*argv, "--steps", "2", "--log-json", str(tmp_path / "b.jsonl")]) == 0
    assert read_log(tmp_path / "b.jsonl")[-1] == {**read_log(tmp_path / "a.jsonl")[-1],
                                                  **{k: v for k, v in read_log(tmp_path / "b.jsonl")[-1].items()
                                                     if k in ("tokens_per_s", "step_s", "peak_rss_bytes")}}


BASE = ["--model", "tiny-llama", "--steps", "2"]


@pytest.mark.parametrize(("argv", "env", "code", "says"), [
    (["--model", "tiny-llama", "--steps", "2", "--optimizer", "sgd"], {}, 2, "invalid choice: 'sgd'"),
    (["--model", "no-such-model", "--steps", "2"], {}, 2, "unknown model 'no-such-model'"),
    ([*BASE, "--ckpt-every", "2"], {}, 2, "--ckpt-every needs --ckpt-dir"),
    ([*BASE, "--export-hf", "out"], {}, 2, "--export-hf needs --ckpt-dir"),
    (["--model", "tiny-llama", "--steps", "0"], {}, 2, "expected a positive integer"),
    ([*BASE, "--optimizer", "muon", "--betas", "0.9,0.95"], {}, 2, "--betas does not apply"),
    ([*BASE, "--batch-size", "3"], {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}, 1, "does not split over 2"),
    ([*BASE, "--optimizer", "muon", "--batch-size", "64"], {"WORLD_SIZE": "64", "RANK": "0", "LOCAL_RANK": "0"}, 1,
     "ranks would hold any parameter"),
    ([*BASE, "--init-from", "{tmp}/nothing"], {}, 1, "--init-from"),
    ([*BASE, "--seq-len", "1000"], {}, 1, "longer than the model's 256 positions"),
])
def test_bad_flags_one_line_before_any_process_group(argv, env, code, says, tmp_path, monkeypatch, capsys):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert train.main(argv) == code
    out = capsys.readouterr()
    lines = out.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("ragfsdp.train: error: ") and says in lines[0], out.err
    assert not torch.distributed.is_initialized()

"""End-to-end demo on local files: train a small Llama at 4 ranks, reshard its checkpoint to 2, resume
there, export to Hugging Face safetensors and load the export with transformers.

Run with `make demo` (or `python tools/demo.py [--out DIR]`). Every step is the public command line a
user would type: `torchrun -m ragfsdp.train` (gloo on CPU, AdamW, auto-checkpointing in the
background), `ragckpt reshard --from 4 --to 2`, then `torchrun -m ragfsdp.train` at 2 ranks on the
resharded copy, which resumes with the optimizer state and the data position of the 4-rank run.
The model is a Llama from a config.json written here (random init, nothing downloaded). Last, an
uninterrupted 4-rank run of all the steps checks that the interrupted, resharded one lost nothing.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import ragckpt

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128, "hidden_size": 128,
         "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 128, "tie_word_embeddings": False}
FIRST_STEPS, MORE_STEPS, EVERY = 24, 12, 8
TRAIN = ["--batch-size", "8", "--seq-len", "64", "--optimizer", "adamw", "--lr", "1e-2", "--seed", "0"]
CKPT = ["--ckpt-every", str(EVERY), "--keep-last", "2"]


def run(cmd: list[str], what: str) -> tuple[str, float]:
    """Run a command with its output shown (indented) and kept; stop the demo if it fails."""
    print(f"\n$ {' '.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        print("    " + line.rstrip(), flush=True)
    if proc.wait() != 0:
        raise SystemExit(f"demo: {what} failed (exit code {proc.returncode})")
    return "".join(lines), time.perf_counter() - t0


def torchrun(nproc: int, args: list[str], what: str) -> tuple[str, float]:
    return run([str(BIN / "torchrun"), "--standalone", f"--nproc-per-node={nproc}", "-m", "ragfsdp.train", *args],
               what)


def losses(path: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, path.read_text().splitlines())]


def save_times(output: str) -> list[tuple[int, float]]:
    return [(int(s), float(t)) for s, t in re.findall(r"committed step (\d+) at \S+ \(([\d.]+) s\)", output)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="directory for checkpoints and logs (default: a temp dir, removed)")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    root = Path(args.out or tempfile.mkdtemp(prefix="ragfsdp-demo-")).resolve()
    for sub in ("ckpt-w4", "ckpt-w2", "hf", "config.json", "train-w4.jsonl", "train-w2.jsonl", "straight.jsonl"):
        p = root / sub
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    root.mkdir(parents=True, exist_ok=True)
    has_hf = importlib.util.find_spec("transformers") is not None
    if has_hf:
        (root / "config.json").write_text(json.dumps(LLAMA, indent=1))
        model = str(root / "config.json")
    else:
        print("transformers is not installed: training the plain-torch gpt-small instead of a Llama, and the "
              "export is not loaded with from_pretrained (pip install transformers for the full demo)")
        model = "gpt-small"
    w4, w2, hf = root / "ckpt-w4", root / "ckpt-w2", root / "hf"

    # 1. 4 ranks, auto-checkpointing every EVERY steps in the background, the newest 2 kept
    out4, t_train4 = torchrun(4, ["--model", model, "--steps", str(FIRST_STEPS), *TRAIN, *CKPT, "--ckpt-dir", str(w4),
                                  "--log-json", str(root / "train-w4.jsonl")], "training at 4 ranks")
    rows = ragckpt.list_checkpoints(str(w4), long=True)
    latest = ragckpt.latest_committed(rows)
    assert latest is not None, rows

    # 2. offline reshard of the newest checkpoint, 4 -> 2 ranks (optimizer state moves with its parameters)
    dst = w2 / Path(latest["url"]).name
    cmd = [str(BIN / "ragckpt"), "reshard", latest["url"], str(dst), "--from", "4", "--to", "2", "--json"]
    print(f"\n$ {' '.join(cmd)}", flush=True)
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"demo: ragckpt reshard failed: {r.stderr.strip()}")
    rep = json.loads(r.stdout)  # --json: stdout is one document
    print(f"    {rep['tensors']} tensors (parameters and AdamW moments), {rep['from_world_size']} -> "
          f"{rep['to_world_size']} ranks in {rep['seconds']:.2f} s", flush=True)

    # 3. resume at 2 ranks from the resharded copy, export at the end
    out2, t_train2 = torchrun(2, ["--model", model, "--steps", str(FIRST_STEPS + MORE_STEPS), *TRAIN, *CKPT,
                                  "--ckpt-dir", str(w2), "--log-json", str(root / "train-w2.jsonl"),
                                  "--export-hf", str(hf)], "resuming at 2 ranks")
    # the copy is a 2-rank checkpoint now, so the checkpointer loads it as one of its own world size
    resumed = re.search(r"resumed step \d+ (from \d+ ranks )?at \d+ ranks", out2)

    # 4. the export, loaded by transformers, holds exactly the final checkpoint's weights
    final = ragckpt.latest_committed(ragckpt.list_checkpoints(str(w2)))
    assert final is not None
    loaded = "not checked (no transformers)"
    if has_hf:
        import torch
        import transformers
        transformers.logging.disable_progress_bar()
        m = transformers.AutoModelForCausalLM.from_pretrained(str(hf))
        ck = ragckpt.open(final["url"])
        same = all(torch.equal(t, ck.read(n)) for n, t in m.state_dict().items())
        n_params = sum(p.numel() for p in m.parameters())
        loaded = (f"{type(m).__name__}.from_pretrained: {n_params:,} parameters, "
                  f"{'bit-identical to' if same else 'DIFFERENT FROM'} {final['url']}")
        if not same:
            raise SystemExit(f"demo: the export differs from the checkpoint it was written from ({final['url']})")

    # 5. the same steps without interruption (no checkpoints): the resumed losses must be these
    _, t_straight = torchrun(4, ["--model", model, "--steps", str(FIRST_STEPS + MORE_STEPS), *TRAIN,
                                 "--log-json", str(root / "straight.jsonl"), "--log-every", "12"],
                             "the uninterrupted run")
    first, second = losses(root / "train-w4.jsonl"), losses(root / "train-w2.jsonl")
    straight = dict(losses(root / "straight.jsonl"))
    gap = max(abs(loss - straight[s]) for s, loss in first + second)
    saves = save_times(out4) + save_times(out2)
    sizes = {Path(r["url"]).name: r.get("bytes") for r in rows if r.get("committed")}
    print("\n== report ==")
    arch = (f"Llama from {root / 'config.json'} ({LLAMA['num_hidden_layers']} layers, hidden {LLAMA['hidden_size']}, "
            f"vocabulary {LLAMA['vocab_size']}; random init)" if has_hf else "gpt-small")
    print(f"model        {arch}, AdamW, batch 8 x 64 tokens")
    print(f"4 ranks      steps 1-{first[-1][0]}: loss {first[0][1]:.4f} -> {first[-1][1]:.4f} ({t_train4:.1f} s)")
    print(f"checkpoints  {', '.join(f'{k} {v / 2**20:.2f} MiB' for k, v in sizes.items() if v)} kept of "
          f"{FIRST_STEPS // EVERY} (keep-last 2)")
    print(f"saves        {', '.join(f'step {s} {t:.2f} s' for s, t in saves)} (background, until committed)")
    print(f"reshard      {Path(latest['url']).name} 4 -> 2 ranks: {rep['seconds']:.2f} s, "
          f"{rep['bytes_written'] / 2**20:.2f} MiB written")
    said = resumed.group(0) + " (the resharded copy)" if resumed else "DID NOT RESUME"
    print(f"2 ranks      {said}; steps {second[0][0]}-{second[-1][0]}: "
          f"loss {second[0][1]:.4f} -> {second[-1][1]:.4f} ({t_train2:.1f} s)")
    print(f"export       {hf}: {loaded}")
    print(f"check        an uninterrupted 4-rank run of steps 1-{FIRST_STEPS + MORE_STEPS} ({t_straight:.1f} s): "
          f"largest loss difference {gap:.1e}")
    print(f"total        {time.perf_counter() - t_start:.1f} s; files in {root}"
          f"{' (removed)' if args.out is None else ''}")
    if args.out is None:
        shutil.rmtree(root, ignore_errors=True)
    return 0 if resumed and gap < 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())

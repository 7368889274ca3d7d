"""docs/ENGINE.md's example runs as written (its own asserts compare against a dense reference), and
what it saves exports to DCP with nothing a torch optimizer would miss (test_dcp.py loads such an
export into a real AdamW)."""

from __future__ import annotations

import re
from pathlib import Path

import ragckpt
from ragckpt.convert.dcp import _left_behind, export_dcp

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "ENGINE.md"


def _example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.S)
    assert len(blocks) == 1, "ENGINE.md should hold exactly one runnable example"
    return blocks[0]


def test_engine_guide_example_runs_and_exports_without_optimizer_gaps(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    scope: dict = {}
    exec(compile(_example(), str(GUIDE), "exec"), scope)  # noqa: S102 - our own documentation
    url = scope["url"]
    ck = ragckpt.open(url)
    assert ck.verify().ok
    for name, value in scope["dense"].items():
        got = ck.read(name)
        assert got.shape == value.shape and bytes(got.numpy().tobytes()) == bytes(value.numpy().tobytes()), name
    steps = [n for n in ck.names() if n.endswith(".step")]
    owners = [int((ck.layout.layout_of(ck.layout.locate(n)[0]).local_units(ck.layout.locate(n)[1]) > 0).sum())
              for n in steps]
    assert len(steps) == 3 and owners == [1, 1, 1]
    # no optimizer gaps; what DCP cannot hold (the user metadata, per-rank extras) is named, not dropped
    warnings = export_dcp(url, str(tmp_path / "dcp")).warnings
    assert warnings == _left_behind(ck), warnings
    assert len(warnings) == 2 and "data_position, step" in warnings[0], warnings
    # and torch's own AdamW, on a module with the example's parameter names, loads the export
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(100, 16)
            self.layer = torch.nn.Linear(16, 16)

    model = Model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    model.layer(model.embed(torch.tensor([3]))).sum().backward()
    opt.step()  # the optimizer has state to fill
    msd, osd = get_state_dict(model, opt, options=flat)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=str(tmp_path / "dcp"))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"], options=flat)
    dense = scope["dense"]
    assert torch.equal(model.embed.weight.detach(), dense["embed.weight"])
    assert torch.equal(opt.state[model.layer.bias]["exp_avg_sq"], dense["optim.state.layer.bias.exp_avg_sq"])
    assert opt.param_groups[0]["lr"] == 1e-3 and opt.param_groups[0]["betas"] == (0.9, 0.95)


def test_with_tensors_adds_an_own_buffer_of_one_dtype():
    import pytest
    import torch

    base = ragckpt.CheckpointLayout.build({"w": ((6, 4), "float32")}, 4, "row")
    lay = base.with_tensors("optim.step", {"optim.state.w.step": ((), "float32")})
    assert [b.name for b in lay.buffers] == ["float32", "optim.step"] and len(lay.layouts) == 2
    assert int(lay.rank_sizes(1).sum()) == 1 and lay.kind == "row"
    with pytest.raises(ragckpt.LayoutError, match="granularity applies to ragged layouts only"):
        base.with_tensors("s", {"t": ((3, 2), "float32")}, granularity="whole")
    with pytest.raises(ragckpt.LayoutError, match="buffer 'x' needs tensors of one dtype"):
        base.with_tensors("x", {"a": ((2,), "float32"), "b": ((2,), torch.bfloat16)})

"""`export-dcp` warns that `dcp.load` into torch's optimizer will miss hyperparameters only when
it will: an FSDP2 save with the default (nested) optimizer state dict keys its groups by index
and lists their parameters in `params`, and the warning took every parameter for one without any."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from click.testing import CliRunner
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

from cli.main import cli
from ragckpt.convert.dcp import export_dcp
from ragckpt.integrations.fsdp2 import save_state_dict


def _trained(seed: int, lr: float) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    fully_shard(m)
    opt = torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=0.05)
    m(torch.randn(5, 4)).sum().backward()
    opt.step()
    return m, opt


def _load(out: Path) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A fresh FSDP2 model and AdamW (another seed and lr) filled from DCP directory `out` by stock
    `dcp.load` and torch's `set_state_dict`, with the default (nested) optimizer state dict."""
    m, opt = _trained(1, 5e-4)
    msd, osd = get_state_dict(m, opt)
    target = {"model": msd, "optim": osd}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, checkpoint_id=str(out))
    set_state_dict(m, opt, model_state_dict=target["model"], optim_state_dict=target["optim"])
    return m, opt


def test_a_default_fsdp2_save_exports_without_a_false_warning_and_loads_into_adamw(group: None,
                                                                                    tmp_path: Path) -> None:
    m, opt = _trained(0, 1e-3)
    msd, osd = get_state_dict(m, opt)
    assert isinstance(osd["param_groups"], list) and "params" in osd["param_groups"][0]  # the nested form
    save_state_dict(str(tmp_path / "ck"), {"model": msd, "optim": osd})
    assert export_dcp(str(tmp_path / "ck"), str(tmp_path / "out")).warnings == []
    res = CliRunner().invoke(cli, ["export-dcp", str(tmp_path / "ck"), str(tmp_path / "out_cli")])
    assert res.exit_code == 0 and "note:" not in res.output, res.output
    m2, opt2 = _load(tmp_path / "out")
    assert opt2.param_groups[0]["lr"] == 1e-3 and opt2.param_groups[0]["weight_decay"] == 0.05
    for (name, p), p2 in zip(m.named_parameters(), m2.parameters(), strict=True):
        assert torch.equal(p.full_tensor(), p2.full_tensor()), name
        for key in ("exp_avg", "exp_avg_sq", "step"):
            got, want = opt2.state[p2][key], opt.state[p][key]
            got, want = (t.full_tensor() if hasattr(t, "full_tensor") else t for t in (got, want))
            assert torch.equal(got, want), (name, key)


def test_a_nested_group_that_lacks_a_hyperparameter_is_warned_about_and_fails_to_load(group: None,
                                                                                      tmp_path: Path) -> None:
    m, opt = _trained(0, 1e-3)
    msd, osd = get_state_dict(m, opt)
    osd["param_groups"] = [{k: v for k, v in g.items() if k != "amsgrad"} for g in osd["param_groups"]]
    save_state_dict(str(tmp_path / "ck"), {"model": msd, "optim": osd})
    (note,) = export_dcp(str(tmp_path / "ck"), str(tmp_path / "out")).warnings
    assert note.startswith("optim.param_groups of 4 parameter(s) with Adam moments lack hyperparameters torch's "
                           "Adam and AdamW keep (for '0.bias': amsgrad)"), note
    with pytest.raises(CheckpointException, match=r"Missing key in checkpoint state_dict: optim\.param_groups\.0\."
                                                  r"amsgrad"):
        _load(tmp_path / "out")

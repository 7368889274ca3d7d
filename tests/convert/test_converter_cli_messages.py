"""The converters' command-line messages: a directory where a weights or data file belongs, a bad
granularity naming the tensor, export-dcp to a URL, import-dcp from a URL holding nothing, the
normalized destination the importers print, a --model-prefix that matches nothing, and the note
that export-hf kept an existing config.json."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import torch

from tests.cli_helpers import (
    one_line_error,
    run,
    save,
)


def _hf_model(d: Path) -> Path:
    from safetensors.torch import save_file

    d.mkdir(parents=True, exist_ok=True)
    save_file({"model.w": torch.randn(10, 7), "lm_head.weight": torch.randn(3, 4)}, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps({"model_type": "x"}))
    return d


def _dcp_dir(d: Path) -> Path:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": {"w": torch.randn(10, 7), "lm_head.weight": torch.randn(3, 4)}, "optim": {"lr": 0.1}},
                 checkpoint_id=str(d))
    return d


def test_import_hf_names_a_directory_in_place_of_the_weights_file(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "model.safetensors").mkdir()
    one_line_error(["import-hf", str(hf), str(tmp_path / "ck"), "-w", "2"],
                   str(hf / "model.safetensors"), "is a directory")
    assert not (tmp_path / "ck").exists()


def test_import_dcp_names_a_directory_in_place_of_a_data_file(tmp_path):
    d = _dcp_dir(tmp_path / "dcp")
    files = sorted(d.glob("*.distcp"))
    os.remove(files[0])
    files[0].mkdir()
    line = one_line_error(["import-dcp", str(d), str(tmp_path / "ck")], str(files[0]), "is a directory")
    assert "truncated" not in line


def test_bad_granularity_names_the_tensor(tmp_path):
    hf = _hf_model(tmp_path / "hf")
    one_line_error(["import-hf", str(hf), str(tmp_path / "ck"), "-w", "2", "--granularity", "7"],
                   "granularity 7", "'lm_head.weight'", "(3, 4)")


def test_export_dcp_to_a_url_advises_exporting_locally_then_uploading(tmp_path):
    ck = save(str(tmp_path / "ck"))
    line = one_line_error(["export-dcp", ck, "s3://bkt/x"], "s3://bkt/x", "export to a local directory")
    assert "copy it to a local" not in line


def test_import_dcp_from_a_url_names_what_is_missing(tmp_path):
    # URLs are read through the stores now (tests/convert/test_dcp_s3.py): no advice to copy, the object named
    line = one_line_error(["import-dcp", "memory://bkt/x", str(tmp_path / "ck")], "memory://bkt/x/.metadata")
    assert "copy it to a local" not in line and not (tmp_path / "ck").exists()


def test_importers_print_the_normalized_destination(tmp_path, monkeypatch):
    hf = _hf_model(tmp_path / "hf")
    d = _dcp_dir(tmp_path / "dcp")
    monkeypatch.chdir(tmp_path)
    rc, out, err = run("import-hf", str(hf), "ck_hf", "-w", "2", "--json")
    assert rc == 0 and json.loads(out)["dst"] == str(tmp_path / "ck_hf"), (out, err)
    rc, out, err = run("import-hf", str(hf), "ck_hf2", "-w", "2")
    assert rc == 0 and f"into {tmp_path / 'ck_hf2'} for" in out, (out, err)
    rc, out, err = run("import-dcp", str(d), "ck_dcp", "--json")
    assert rc == 0 and json.loads(out)["destination"] == str(tmp_path / "ck_dcp"), (out, err)
    rc, out, err = run("import-dcp", str(d), "file://" + str(tmp_path / "ck_dcp2"))
    assert rc == 0 and f"into {tmp_path / 'ck_dcp2'} for" in out, (out, err)


def test_import_dcp_model_prefix_matching_nothing_is_refused(tmp_path):
    d = _dcp_dir(tmp_path / "dcp")
    one_line_error(["import-dcp", str(d), str(tmp_path / "ck"), "--model-prefix", "zzz."],
                   "model prefix 'zzz.' matches none", str(d))
    assert not (tmp_path / "ck").exists()
    rc, out, err = run("import-dcp", str(d), str(tmp_path / "ck2"), "--model-prefix", "model.", "--json")
    assert rc == 0, err


def test_export_hf_says_it_kept_an_existing_config(tmp_path):
    hf = _hf_model(tmp_path / "hf")
    ck = str(tmp_path / "ck")
    assert run("import-hf", str(hf), ck, "-w", "2")[0] == 0
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    (out_dir / "config.json").write_text('{"mine": 1}')
    rc, out, err = run("export-hf", ck, str(out_dir))
    assert rc == 0, err
    assert f"note: kept the config.json already in {out_dir}" in out
    assert json.loads((out_dir / "config.json").read_text()) == {"mine": 1}

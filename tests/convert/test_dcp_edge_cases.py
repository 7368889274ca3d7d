"""DCP conversion edge cases: a damaged `.metadata` that still unpickles (a non-dtype, a dtype given as
text, a non-string key) is one line, and export-dcp never replaces a file where OUT_DIR should be."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ragckpt
from ragckpt.convert.dcp import export_dcp, import_dcp
from ragckpt.errors import DestinationExistsError, FormatError
from tests.helpers import cli_error


@pytest.fixture
def dcp_dir(tmp_path: Path) -> Path:
    d = tmp_path / "dcp"
    dcp.save({"model": {"a": torch.arange(6.0).reshape(2, 3)}}, checkpoint_id=str(d), no_dist=True)
    return d


def _damage_metadata(d: Path, change) -> None:
    md = pickle.loads((d / ".metadata").read_bytes())
    change(md)
    (d / ".metadata").write_bytes(pickle.dumps(md))


def test_metadata_with_a_non_dtype_is_one_line(dcp_dir, tmp_path):
    def change(md):
        md.state_dict_metadata["model.a"].properties = None

    _damage_metadata(dcp_dir, change)
    line = cli_error("import-dcp", str(dcp_dir), str(tmp_path / "rag"), "-w", "2")
    assert "/.metadata: tensor 'model.a' has dtype None, not a torch dtype; the metadata is corrupt" in line
    assert not (tmp_path / "rag").exists()


def test_metadata_with_a_dtype_given_as_text_shows_it_as_text(dcp_dir, tmp_path):
    def change(md):
        md.state_dict_metadata["model.a"].properties.dtype = "float32"

    _damage_metadata(dcp_dir, change)
    with pytest.raises(FormatError, match="tensor 'model.a' has dtype 'float32', not a torch dtype"):
        import_dcp(str(dcp_dir), str(tmp_path / "rag"), world_size=2)


def test_metadata_with_a_non_string_key_is_one_line(dcp_dir, tmp_path):
    def change(md):
        md.state_dict_metadata[7] = md.state_dict_metadata.pop("model.a")

    _damage_metadata(dcp_dir, change)
    line = cli_error("import-dcp", str(dcp_dir), str(tmp_path / "rag"), "-w", "2")
    assert "/.metadata: holds the key 7, which is not a string; the metadata is corrupt" in line


@pytest.mark.parametrize("overwrite", [False, True])
def test_export_dcp_never_replaces_a_file(tmp_path, overwrite):
    """The CLI refused a file (click's 'Directory ... is a file', also with --overwrite) while the
    Python API replaced it with overwrite=True; both now refuse it, as reshard and export-hf do."""
    ragckpt.write_global({"a": torch.ones(3)}, str(tmp_path / "ck"), 2)
    f = tmp_path / "out"
    f.write_bytes(b"keep me")
    line = cli_error("export-dcp", str(tmp_path / "ck"), str(f), *(["--overwrite"] if overwrite else []))
    assert f"{f} exists and is not a directory" in line and "never replaces a file" in line
    with pytest.raises(DestinationExistsError, match="never replaces a file"):
        export_dcp(str(tmp_path / "ck"), str(f), overwrite=overwrite)
    assert f.read_bytes() == b"keep me"

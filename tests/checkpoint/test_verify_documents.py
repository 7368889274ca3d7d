"""`verify` checks every document a plain Zarr v3 reader walks (the group and array documents) and
every rank's record: garbage, a cut, a deletion or valid JSON of the wrong shape in any of them is
reported with the object named (verify printed OK for the group documents and the records, while
the plain-zarr reading of FORMAT.md raised or listed fewer arrays)."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import ragckpt
from ragckpt.errors import RagckptError
from tests.helpers import cli_run


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(7, 3, generator=g), "b": torch.randn(5, generator=g).to(torch.bfloat16),
            "step": torch.tensor(3, dtype=torch.int64)}


@pytest.fixture(scope="module")
def ck(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("docs") / "ck"
    ragckpt.write_global(_state(), str(path), 3, "row")  # row: it has a units table and its group
    return path


def _documents(root: Path) -> list[str]:
    """Every zarr document and rank record of the checkpoint at `root`, as keys."""
    keys = [str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()]
    return sorted(k for k in keys if k.endswith("zarr.json") or k.startswith("ranks/"))


def _wrong_shape(key: str, raw: bytes) -> bytes:
    """Valid JSON that is not what `key` must hold."""
    doc = json.loads(raw)
    if key.startswith("ranks/"):
        return json.dumps({**doc, "buffers": {}}).encode()
    if doc.get("node_type") == "group":
        return json.dumps({**doc, "node_type": "array"}).encode()
    return json.dumps({"zarr_format": 3, "node_type": "group", "attributes": doc.get("attributes", {})}).encode()


DAMAGES = {
    "garbage": lambda key, raw: b"\x00\xffgarbage",
    "truncated": lambda key, raw: raw[: len(raw) // 2],
    "deleted": None,
    "wrong shape": _wrong_shape,
}


def test_the_checkpoint_has_the_documents_format_md_lists(ck):
    assert _documents(ck) == ["buffers/0/zarr.json", "buffers/1/zarr.json", "buffers/2/zarr.json",
                              "buffers/zarr.json", "meta/crc/0/zarr.json", "meta/crc/1/zarr.json",
                              "meta/crc/2/zarr.json", "meta/crc/zarr.json", "meta/extra/zarr.json",
                              "meta/units/0/zarr.json", "meta/units/1/zarr.json", "meta/units/2/zarr.json",
                              "meta/units/zarr.json", "meta/zarr.json", "ranks/0.json", "ranks/1.json",
                              "ranks/2.json", "zarr.json"]


def _verdict(url: str) -> tuple[int, str]:
    """`ragckpt verify --json URL`: its exit code and everything it said about problems."""
    code, out, err = cli_run("verify", "--json", url)
    assert "Traceback" not in err, err
    doc = json.loads(out)
    if code == 1:
        assert doc["ok"] is False and doc["problems"], doc
        return code, "\n".join(doc["problems"])
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: "), (code, err)
    return code, doc["error"]


def test_every_damaged_document_is_named_by_verify(ck, tmp_path):
    failures = []
    for key in _documents(ck):
        for damage, how in DAMAGES.items():
            case = tmp_path / f"{key.replace('/', '_')}-{damage.replace(' ', '_')}"
            shutil.copytree(ck, case)
            f = case / key
            if how is None:
                f.unlink()
            else:
                f.write_bytes(how(key, f.read_bytes()))
            code, said = _verdict(str(case))
            if key not in said:
                failures.append(f"{key} {damage}: exit {code}, {said!r}")
                continue
            try:  # the library says the same: an error naming it, or a report that is not OK
                rep = ragckpt.open(str(case)).verify()
                if rep.ok or not any(key in p for p in rep.problems):
                    failures.append(f"{key} {damage}: verify() {rep.problems}")
            except RagckptError as e:
                if key not in str(e) or "\n" in str(e):
                    failures.append(f"{key} {damage}: {e}")
            shutil.rmtree(case)
    assert not failures, "\n".join(failures)


def test_an_untouched_checkpoint_verifies_and_reads_with_plain_zarr(ck):
    import zarr

    code, out, err = cli_run("verify", "--json", str(ck))
    assert code == 0 and json.loads(out)["ok"] is True, (out, err)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ranks/, COMMITTED: not zarr nodes (FORMAT.md section 2)
        g = zarr.open_group(str(ck), mode="r")
        arrays = sorted(name for name, node in g.members(max_depth=None) if isinstance(node, zarr.Array))
    assert arrays == ["buffers/0", "buffers/1", "buffers/2", "meta/crc/0", "meta/crc/1", "meta/crc/2",
                      "meta/extra", "meta/units/0", "meta/units/1", "meta/units/2"]
    rd = ragckpt.open(str(ck))
    m = g.attrs["ragckpt"]
    for b, spec in enumerate(m["buffers"]):
        rows = g[f"buffers/{b}"][...]
        for r in range(m["world_size"]):
            want = rd.read_rank(spec["name"], r)
            got = torch.from_numpy(np.ascontiguousarray(rows[r, : want.numel()]))
            assert torch.equal(got.view(want.dtype) if got.dtype != want.dtype else got, want)
    units = g["meta/units/0"][...]  # FORMAT.md section 6 by hand: rows of w held by each rank
    assert units.tolist() == [[3, 3, 1]] and m["layouts"][0]["shapes"] == [[7, 3]]


def test_a_group_document_reformatted_or_with_attributes_is_still_fine(ck, tmp_path):
    """Group documents are checked for what plain zarr reads (zarr_format, node_type, attributes),
    not byte for byte: a reformatted one, or one a user gave attributes, is a good group."""
    case = tmp_path / "ck"
    shutil.copytree(ck, case)
    (case / "buffers/zarr.json").write_text(json.dumps({"node_type": "group", "zarr_format": 3,
                                                        "attributes": {"note": "mine"}}))
    (case / "meta/zarr.json").write_text('{"zarr_format":3,"node_type":"group"}')
    assert ragckpt.open(str(case)).verify().ok

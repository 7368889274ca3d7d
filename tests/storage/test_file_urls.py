"""file:// URLs name files on this machine: `file:///p` and `file://localhost/p` are both `/p`
(RFC 8089), in every command that takes a path. `file://localhost/p` used to be read as the relative
path `localhost/p`, so a reshard "succeeded" into a directory under the working directory; a
file:// URL naming another host is refused in one line, and nothing is written."""

from __future__ import annotations

import os

import pytest
import torch

import ragckpt
from ragckpt.convert.dcp import export_dcp, import_dcp
from ragckpt.convert.hf_export import export_hf
from ragckpt.convert.hf_import import import_hf
from ragckpt.errors import RagckptError
from ragckpt.storage.store import local_path
from tests.helpers import assert_bit_equal, cli_error, cli_run, special_tensor

STATE = {"model.w": special_tensor((9, 4), torch.bfloat16, 1), "model.n": special_tensor((4,), torch.float32, 2)}


def test_local_path_of_every_spelling():
    assert local_path("/a/b") == "/a/b" and local_path("rel/b") == "rel/b"
    assert local_path("file:///a/b") == "/a/b" and local_path("FILE:///a/b") == "/a/b"
    assert local_path("file://localhost/a/b") == "/a/b" and local_path("file://LocalHost/a") == "/a"
    assert local_path("file:/a/b") == "/a/b"  # RFC 8089's minimal form
    assert local_path("s3://bucket/a") is None and local_path("memory://x") is None
    # percent-encoded as Path.as_uri() writes it; a plain path keeps its '%'
    assert local_path("file:///a/my%20ck%25") == "/a/my ck%" == local_path("file://localhost/a/my%20ck%25")
    assert local_path("file:/a/%C3%A9") == "/a/\u00e9" and local_path("/a/my%20ck") == "/a/my%20ck"
    for url, why in (("file://otherhost/a", "names host 'otherhost'"), ("file://tmp/x", "names host 'tmp'"),
                     ("file://", "names no path"), ("file://localhost", "names no path")):
        with pytest.raises(RagckptError, match=why):
            local_path(url)


def test_every_command_reads_and_writes_file_localhost_urls_where_they_point(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a misread URL would land in ./localhost
    ragckpt.write_global(STATE, str(tmp_path / "src"), 3)
    url = f"file://localhost{tmp_path}"
    code, out, err = cli_run("info", f"{url}/src")
    assert code == 0, err
    code, out, err = cli_run("reshard", f"{url}/src", f"{url}/dst", "--to", "2")
    assert code == 0, err
    assert ragckpt.open(str(tmp_path / "dst")).world_size == 2
    export_hf(f"{url}/dst", f"{url}/hf", write_config=False)
    import_hf(f"{url}/hf", f"{url}/from_hf", 2)
    import_hf(f"{url}/hf/model.safetensors", f"{url}/from_file", 1)
    export_dcp(f"{url}/from_hf", f"{url}/dcp")
    import_dcp(f"{url}/dcp", f"{url}/back")
    for where in ("dst", "from_hf", "from_file", "back"):
        ck = ragckpt.open(str(tmp_path / where))
        for name, t in STATE.items():
            assert_bit_equal(ck.read(name), t, f"{where}: {name}")
    assert not (tmp_path / "localhost").exists()


def test_a_path_uri_with_spaces_names_that_path(tmp_path):
    """`Path.as_uri()` percent-encodes: 'file:///.../my%20run' used to be read (and written) as a
    directory literally named 'my%20run'."""
    src = tmp_path / "my run"
    ragckpt.write_global(STATE, str(src), 3)
    code, out, err = cli_run("reshard", src.as_uri(), (tmp_path / "new run").as_uri(), "--to", "2")
    assert code == 0, err
    assert sorted(os.listdir(tmp_path)) == ["my run", "new run"]
    ck = ragckpt.open((tmp_path / "new run").as_uri())
    for name, t in STATE.items():
        assert_bit_equal(ck.read(name), t, name)


def test_a_file_url_naming_another_host_is_refused_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ragckpt.write_global(STATE, str(tmp_path / "src"), 3)
    other = f"file://otherhost{tmp_path}"
    for args in (("info", f"{other}/src"), ("reshard", str(tmp_path / "src"), f"{other}/dst", "--to", "2"),
                 ("export-hf", str(tmp_path / "src"), f"{other}/hf"), ("export-dcp", str(tmp_path / "src"), f"{other}/dcp"),
                 ("import-hf", f"{other}/hf", f"{tmp_path}/x", "-w", "2")):
        line = cli_error(*args)
        assert "names host 'otherhost'" in line and "file:///path" in line, line
    assert sorted(os.listdir(tmp_path)) == ["src"]

"""Permission errors at the command line: `info`, `verify` and `export-dcp` on directories the user
may not read or write say "permission denied" and name the path, in one line, leaving nothing behind.

The commands run as a user that file modes apply to: as root, `nobody` (setpriv) in a scratch
directory everyone can enter (`shared_dir`); as anyone else, this process after a chmod."""

from __future__ import annotations

import os

from tests.cli_helpers import (
    as_unprivileged,
    assert_one_line,
    mode,
    save,
)


def test_info_of_an_unreadable_directory_says_permission_denied(shared_dir):
    d = shared_dir / "ud"
    save(str(d))
    with mode(d, 0o000):
        rc, out, err = as_unprivileged("info", str(d))
        line = assert_one_line(rc, err, str(d), "permission denied")
        assert "no ragckpt checkpoint" not in line
        rc, out, err = as_unprivileged("verify", str(d))
        assert_one_line(rc, err, str(d), "permission denied")


def test_export_dcp_permission_error_names_the_destination(shared_dir):
    ck = save(str(shared_dir / "ck"))
    ro = shared_dir / "rodir"
    ro.mkdir()
    with mode(ro, 0o555):
        rc, out, err = as_unprivileged("export-dcp", ck, str(ro / "d"))
    line = assert_one_line(rc, err, f"{ro / 'd'}:", "permission denied")
    assert ".tmp-" not in line
    assert os.listdir(ro) == []

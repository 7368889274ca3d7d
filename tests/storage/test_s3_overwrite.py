"""`--overwrite` of an S3 destination loses nothing when the job fails half way: the old objects are
copied aside server-side (S3 has no rename) and copied back, commit marker last."""

from __future__ import annotations

import hashlib
import os

import pytest
import torch

import ragckpt
from ragckpt.checkpoint.writer import write_streaming
from ragckpt.errors import IntegrityError
from ragckpt.storage.destination import MARKER_KEY
from ragckpt.storage.remote import S3Store
from tests.conftest import cli_storage_args
from tests.helpers import assert_bit_equal, cli_run, fill_failing_at, special_tensor
from tests.reshard.test_reshard_cli import flip_byte, make_state, same_bits
from tests.s3_fault_proxy import ACCESS_DENIED


def prefix_digest(s3, name: str) -> dict[str, str]:
    """sha256 of every object under the test's prefix + `name`, read with plain s3fs (no ragckpt code)."""
    fs = s3.fs()
    fs.invalidate_cache()
    base = f"{s3.url.split('://', 1)[1]}/{name}/"
    out = {p[len(base):]: hashlib.sha256(fs.cat_file(p)).hexdigest() for p in sorted(fs.find(base))}
    assert "COMMITTED" in out and len(out) > 5, out
    return out


def without_marker(digest: dict) -> dict:
    """A set-aside copy's objects but the marker that says what the copy is (destination.MARKER_KEY)."""
    return {k: v for k, v in digest.items() if k != MARKER_KEY}


def names_beside(s3) -> list[str]:
    """What the test's prefix holds at its top level."""
    fs = s3.fs()
    fs.invalidate_cache()
    base = s3.url.split("://", 1)[1]
    return sorted(p[len(base) + 1:] for p in fs.ls(base, detail=False))


def test_reshard_overwrite_from_a_source_damaged_inside_an_object_leaves_s3_dst_as_it_was(s3, fast_dir):
    state = make_state(20_000)
    src, bad, dst = f"{fast_dir}/src", f"{fast_dir}/bad", f"{s3.url}/dst"
    ragckpt.write_global(state, src, 3, "ragged")
    ragckpt.write_global(state, bad, 3, "ragged")
    flip_byte(f"{bad}/buffers/0/c.1.0")
    code, _, err = cli_run("reshard", src, dst, "--to", "2", *s3.cli_args())
    assert code == 0, err
    before = prefix_digest(s3, "dst")

    code, _, err = cli_run("reshard", bad, dst, "--to", "4", "--overwrite", *s3.cli_args())
    assert code == 2 and "c.1.0" in err and f"{dst} was left as it was" in err, err
    assert prefix_digest(s3, "dst") == before
    assert names_beside(s3) == ["dst"]  # nothing set aside is left behind
    ck = ragckpt.open(dst, storage_options=s3.storage_options)
    assert ck.world_size == 2 and ck.verify().ok

    code, _, err = cli_run("reshard", src, dst, "--to", "4", "--overwrite", *s3.cli_args())
    assert code == 0, err
    assert ragckpt.open(dst, storage_options=s3.storage_options).world_size == 4
    assert names_beside(s3) == ["dst"]
    ck = ragckpt.open(dst, storage_options=s3.storage_options)
    assert all(same_bits(ck.read(k), v) for k, v in state.items())


def test_objects_beyond_one_copy_request_are_set_aside_in_parts(s3, monkeypatch):
    """S3 copies at most 5 GiB in one CopyObject; larger objects go part by part
    (UploadPartCopy). Lowered limits exercise that path with a few MiB."""
    monkeypatch.setattr(S3Store, "copy_whole_limit", 6 << 20)
    monkeypatch.setattr(S3Store, "copy_part_bytes", 5 << 20)
    part_copies = []
    part_copy = S3Store._copy_part

    async def counted(self, *a, **kw):
        part_copies.append(a)
        return await part_copy(self, *a, **kw)

    monkeypatch.setattr(S3Store, "_copy_part", counted)
    url = f"{s3.url}/ck"
    old = {"w": special_tensor((3 << 20,), torch.float32, 7)}  # 12 MiB: one chunk object per rank
    ragckpt.write_global(old, url, 1, storage_options=s3.storage_options)
    before = prefix_digest(s3, "ck")
    assert max(s3.fs().size(f"{s3.url.split('://', 1)[1]}/ck/{k}") for k in before) > 6 << 20
    lay, fill_for = fill_failing_at(3, IntegrityError("the input is damaged (test)"))

    with pytest.raises(IntegrityError, match=f"{url} was left as it was"):
        write_streaming(url, lay, fill_for, overwrite=True, workers=1, storage_options=s3.storage_options)
    assert prefix_digest(s3, "ck") == before and names_beside(s3) == ["ck"]
    assert len(part_copies) >= 6  # 12 MiB in 5 MiB parts, set aside and put back
    assert_bit_equal(ragckpt.open(url, storage_options=s3.storage_options).read("w"), old["w"])


def test_an_interrupt_during_an_s3_overwrite_puts_the_old_objects_back(s3):
    url = f"{s3.url}/ck"
    old = {"w": special_tensor((40, 6), torch.float32, 1)}
    ragckpt.write_global(old, url, 3, storage_options=s3.storage_options)
    before = prefix_digest(s3, "ck")
    lay = ragckpt.CheckpointLayout.build({"v": ((4096,), "float32")}, 4, "row")
    data = torch.zeros(4096).view(torch.uint8).numpy().data

    def fill_for(bi: int, r: int):
        def fill(lo: int, hi: int):
            if r == 2:
                raise KeyboardInterrupt
            return data[r * 4096 + lo * 4 : r * 4096 + hi * 4]
        return fill

    with pytest.raises(KeyboardInterrupt) as e:
        write_streaming(url, lay, fill_for, overwrite=True, workers=1, storage_options=s3.storage_options)
    assert e.value.ragckpt_note == f"{url} was left as it was"
    assert prefix_digest(s3, "ck") == before and names_beside(s3) == ["ck"]


def test_a_set_aside_prefix_left_by_a_killed_overwrite_is_moved_back_by_the_next_run(s3, fast_dir):
    """A whole, committed copy beside a DST with no checkpoint (an overwrite killed after emptying
    DST): the next run into DST copies it back first, then finds DST committed and refuses."""
    state = make_state(2_000)
    src, dst = f"{fast_dir}/src", f"{s3.url}/dst"
    ragckpt.write_global(state, src, 3, "ragged")
    ragckpt.write_global(state, f"{dst}.replaced-0123456789ab", 3, "ragged", storage_options=s3.storage_options)
    code, out, err = cli_run("reshard", src, dst, "--to", "2", *s3.cli_args())
    assert code == 2 and "already holds a committed checkpoint" in err, err
    assert names_beside(s3) == ["dst"]
    ck = ragckpt.open(dst, storage_options=s3.storage_options)
    assert ck.world_size == 3 and ck.verify().ok


def test_a_bucket_root_cannot_be_set_aside_so_the_source_is_checked_first(s3, fast_dir):
    """With no sibling prefix to copy to, an overwrite of a bucket's root refuses a source with an
    object missing before it deletes anything."""
    state = make_state(20_000)
    src, bad, dst = f"{fast_dir}/src", f"{fast_dir}/bad", f"s3://{s3.bucket}"
    ragckpt.write_global(state, src, 3, "ragged")
    ragckpt.write_global(state, bad, 3, "ragged")
    os.unlink(f"{bad}/buffers/0/c.1.0")
    code, _, err = cli_run("reshard", src, dst, "--to", "2", *s3.cli_args())
    assert code == 0, err
    code, _, err = cli_run("reshard", bad, dst, "--to", "4", "--overwrite", *s3.cli_args())
    assert code == 2 and "bad/buffers/0/c.1.0 is missing" in err and "nothing was written or overwritten" in err, err
    ck = ragckpt.open(dst, storage_options=s3.storage_options)
    assert ck.world_size == 2 and ck.verify().ok


# -- credentials scoped to DST, and failures half way (a review's findings) ---------------------------------

def _denied(s3_faulty, methods: set[str], path_regex: str) -> None:
    s3_faulty.proxy.configure(reply=ACCESS_DENIED, methods=methods, path_regex=path_regex,
                              max_faults=10**6, max_faults_per_request=10**6)


def test_credentials_that_may_list_only_dst_still_write_it(s3_faulty, fast_dir):
    """Looking for leftover set-asides lists DST's siblings: a policy that allows listing only
    under DST's own prefix makes that lookup find nothing instead of failing the job."""
    src = f"{fast_dir}/src"
    ragckpt.write_global(make_state(2000), src, 2, "row")
    _denied(s3_faulty, {"GET"}, r"prefix=run%2Fdst\.replaced")
    code, _, err = cli_run("reshard", src, f"{s3_faulty.url}/dst", "--to", "3", *cli_storage_args(s3_faulty.storage_options))
    assert code == 0, err
    assert s3_faulty.proxy.stats.canned >= 1  # the sibling listing was refused, and did not matter


def test_an_overwrite_that_may_not_write_beside_dst_replaces_it_in_place(s3_faulty, fast_dir):
    src = f"{fast_dir}/src"
    state = make_state(2000)
    ragckpt.write_global(state, src, 2, "row")
    args = cli_storage_args(s3_faulty.storage_options)
    dst = f"{s3_faulty.url}/dst"
    assert cli_run("reshard", src, dst, "--to", "3", *args)[0] == 0
    _denied(s3_faulty, {"PUT"}, r"/run/dst\.replaced-")
    code, _, err = cli_run("reshard", src, dst, "--to", "4", "--overwrite", *args)
    assert code == 0, err
    assert s3_faulty.proxy.stats.canned >= 1
    s3_faulty.proxy.configure()
    ck = ragckpt.open(dst, storage_options=s3_faulty.storage_options)
    assert ck.world_size == 4 and all(same_bits(ck.read(k), v) for k, v in state.items())
    assert names_beside(s3_faulty.direct) == ["dst"]


def test_a_failure_while_emptying_dst_after_the_copy_says_where_the_old_contents_are(s3_faulty, fast_dir):
    src = f"{fast_dir}/src"
    ragckpt.write_global(make_state(2000), src, 2, "row")
    args = cli_storage_args(s3_faulty.storage_options)
    dst = f"{s3_faulty.url}/dst"
    assert cli_run("reshard", src, dst, "--to", "3", *args)[0] == 0
    before = prefix_digest(s3_faulty.direct, "dst")
    _denied(s3_faulty, {"POST"}, r"\?delete")  # the bulk delete is refused
    code, _, err = cli_run("reshard", src, dst, "--to", "4", "--overwrite", *args)
    s3_faulty.proxy.configure()
    aside = [n for n in names_beside(s3_faulty.direct) if n.startswith("dst.replaced-")]
    assert code == 2 and len(aside) == 1, (err, aside)
    assert f"the previous contents of {dst} are in {s3_faulty.url}/{aside[0]}" in err, err
    assert without_marker(prefix_digest(s3_faulty.direct, aside[0])) == before  # the old checkpoint, whole


def test_an_outage_during_an_s3_overwrite_keeps_its_own_error_and_names_the_set_aside_copy(s3_faulty, fast_dir):
    """The store stops answering half way: the job's failure is reported (not the failure to check
    for a commit afterwards), and it says where the old contents are."""
    src = f"{fast_dir}/src"
    ragckpt.write_global(make_state(20_000), src, 2, "row")
    dst, opts = f"{s3_faulty.url}/dst", s3_faulty.storage_options
    ragckpt.reshard.reshard(src, dst, 3, storage_options=opts)
    before = prefix_digest(s3_faulty.direct, "dst")

    def outage(n: int) -> None:
        s3_faulty.proxy.configure(fail_all=True, max_faults=10**6, max_faults_per_request=10**6)

    with pytest.raises(ragckpt.RagckptError) as e:
        ragckpt.reshard.reshard(src, dst, 4, overwrite=True, storage_options=opts, progress=outage)
    s3_faulty.proxy.configure()
    aside = [n for n in names_beside(s3_faulty.direct) if n.startswith("dst.replaced-")]
    assert len(aside) == 1 and f"the previous contents of {dst} are in {s3_faulty.url}/{aside[0]}" in str(e.value)
    assert "COMMITTED" not in str(e.value).split(";")[0], e.value  # the job's own error comes first
    assert without_marker(prefix_digest(s3_faulty.direct, aside[0])) == before

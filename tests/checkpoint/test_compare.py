"""`ragckpt.checkpoint.compare` and `ragckpt diff`: bit-level comparison across world sizes and layouts."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
import torch

import ragckpt
from ragckpt import IntegrityError, OptionError, UnknownNameError
from ragckpt.checkpoint.compare import MIN_WINDOW_BYTES, compare, min_window_bytes
from ragckpt.checkpoint.reader import Checkpoint
from ragckpt.format.dtypes import itemsize
from tests.helpers import ALL_DTYPES, MORE_DTYPES, cli_error, cli_run, odd_state, special_tensor


@pytest.fixture
def state() -> dict[str, torch.Tensor]:
    s = odd_state()  # odd shapes
    for i, dt in enumerate(ALL_DTYPES + MORE_DTYPES):  # and every dtype
        s[f"d.{str(dt).split('.')[-1]}"] = special_tensor((9, 5), dt, seed=20 + i)
    s["big"] = special_tensor((257, 33), torch.float32, seed=9)
    return s


def _flip_bits(t: torch.Tensor, flat_index: int, mask: int = 1) -> torch.Tensor:
    """A copy of `t` with one element's lowest byte XORed by `mask`."""
    out = t.clone().reshape(-1)
    raw = out.view(torch.uint8) if out.dtype != torch.bool else out.view(torch.uint8)
    w = out.element_size()
    raw.view(-1)[flat_index * w] ^= mask
    return out.reshape(t.shape)


def test_same_tensors_in_other_world_sizes_and_layouts_compare_identical(tmp_path, state):
    # 4 KiB checksum blocks, so that a 1 MiB window holds 3 threads
    ragckpt.write_global(state, str(tmp_path / "a"), world_size=8, layout="ragged", block_bytes=4096)
    ragckpt.write_global(state, str(tmp_path / "b"), world_size=3, layout="row", block_bytes=4096)
    ragckpt.write_global(state, str(tmp_path / "c"), world_size=5, layout="element", block_bytes=4096)
    for other in ("b", "c"):
        rep = compare(str(tmp_path / "a"), str(tmp_path / other), window_bytes=1 << 20, workers=3)
        assert rep.ok, rep.differences
        assert rep.compared == rep.identical == len(state)
        assert rep.bytes == sum(t.numel() * t.element_size() for t in state.values())


def test_every_kind_of_difference_is_named(tmp_path, state):
    ragckpt.write_global(state, str(tmp_path / "a"), world_size=4, layout="ragged")
    other = dict(state)
    names = sorted(state)
    # a NaN whose payload differs is still a difference; -0.0 against 0.0 too
    f32 = next(n for n in names if n != "big" and state[n].dtype == torch.float32 and state[n].numel() > 8)
    other[f32] = state[f32].clone()
    flat = other[f32].reshape(-1)
    flat[6] = -0.0
    flat[7] = 0.0
    base = state[f32].reshape(-1)
    want_count = int((flat.view(torch.int32) != base.view(torch.int32)).sum())
    nan_at = 0  # special_tensor plants a NaN first
    other[f32] = _flip_bits(other[f32], nan_at)
    want_count += 1
    other["d.complex128"] = state["d.complex128"].clone()
    other["d.complex128"].reshape(-1).view(torch.uint8)[3 * 16 + 8] ^= 0x01  # the imaginary part's lowest byte
    dropped = "d.bool"
    del other[dropped]
    other["new.tensor"] = torch.ones(3)
    reshaped = "big"
    other[reshaped] = state[reshaped].reshape(33, 257)
    retyped = "d.int32"
    other[retyped] = state[retyped].to(torch.int64)
    ragckpt.write_global(other, str(tmp_path / "b"), world_size=3, layout="row")

    rep = compare(str(tmp_path / "a"), str(tmp_path / "b"))
    kinds = {d.name: d.kind for d in rep.differences}
    assert kinds == {dropped: "only_a", "new.tensor": "only_b", reshaped: "shape", retyped: "dtype", f32: "values",
                     "d.complex128": "values"}
    cplx = next(d for d in rep.differences if d.name == "d.complex128")
    assert cplx.differing == 1 and cplx.first_index == (0, 3)
    vals = next(d for d in rep.differences if d.name == f32)
    assert vals.differing == want_count and vals.numel == state[f32].numel()
    assert vals.first_index == tuple(int(i) for i in np.unravel_index(0, state[f32].shape))
    want_gap = max(abs(float(base[6])), abs(float(base[7])))  # the NaN with another payload has no distance
    assert vals.max_abs_diff == want_gap
    assert rep.compared == len(state) - 3  # not the one-sided, reshaped or retyped ones
    assert rep.identical == rep.compared - 2
    assert not rep.ok


def test_first_difference_and_count_across_many_windows_and_threads(tmp_path):
    base = torch.arange(200_000, dtype=torch.float32)
    ragckpt.write_global({"x": base}, str(tmp_path / "a"), world_size=7, layout="element", block_bytes=4096)
    changed = base.clone()
    where = [199_999, 150_003, 70_000, 31_337, 90_000]
    changed[where] += 2.5
    changed[120_000] -= 100
    ragckpt.write_global({"x": changed}, str(tmp_path / "b"), world_size=2, layout="row", block_bytes=4096)
    least = min_window_bytes(ragckpt.open(str(tmp_path / "a")), ragckpt.open(str(tmp_path / "b")))
    assert least == 4 * MIN_WINDOW_BYTES + 4 * 4096
    # the least window, 1 thread; twice it across 2 threads: windows of 64 KiB each side
    for window, workers in ((least, 4), (2 * least, 4)):
        rep = compare(str(tmp_path / "a"), str(tmp_path / "b"), window_bytes=window, workers=workers)
        (d,) = rep.differences
        assert d.differing == 6
        assert d.first_index == (31_337,) and d.first_values == (31337.0, 31339.5)
        assert d.max_abs_diff == 100.0


def test_windows_finishing_out_of_order_keep_the_first_difference():
    from ragckpt.checkpoint.compare import _Tally

    t = _Tally("x", (4, 5), 20)
    a = torch.zeros(10)
    b = a.clone()
    b[[3, 8]] = 1.0
    t.add(10, a, b)  # the later window lands first
    b2 = a.clone()
    b2[7] = -4.0
    t.add(0, a, b2)
    d = t.difference()
    assert d.differing == 3 and d.first_index == (1, 2) and d.first_values == (0.0, -4.0) and d.max_abs_diff == 4.0


def test_reads_stay_inside_the_window(tmp_path, monkeypatch):
    ragckpt.write_global({"x": torch.randn(300_000), "y": torch.randn(1000, 77).bfloat16()},
                         str(tmp_path / "a"), world_size=5, layout="ragged", block_bytes=4096)
    ragckpt.write_global({"x": torch.randn(300_000), "y": torch.randn(1000, 77).bfloat16()},
                         str(tmp_path / "b"), world_size=2, layout="row", block_bytes=4096)
    real = Checkpoint.read_flat
    biggest = [0]
    threads: set[int] = set()
    lock = threading.Lock()

    def spying(self, name, start=0, stop=None, out=None):
        stop = self.meta(name).numel if stop is None else stop
        with lock:
            biggest[0] = max(biggest[0], (stop - start) * itemsize(self.meta(name).dtype))
            threads.add(threading.get_ident())
        return real(self, name, start, stop, out)

    monkeypatch.setattr(Checkpoint, "read_flat", spying)
    window = 3 * min_window_bytes(ragckpt.open(str(tmp_path / "a")), ragckpt.open(str(tmp_path / "b")))
    rep = compare(str(tmp_path / "a"), str(tmp_path / "b"), window_bytes=window, workers=8)
    assert {d.name for d in rep.differences} == {"x", "y"}
    # each thread holds one read of each side at a time
    assert 0 < 2 * biggest[0] * len(threads) <= window, (biggest, len(threads))


def test_every_buffer_a_thread_holds_fits_in_the_window(tmp_path, monkeypatch):
    """Counting every per-thread buffer (each side's window, and each reader's scratch for the
    checksum blocks a window's ends cut): together they stay within the window. With 1 MiB blocks,
    8 threads of 256 KiB windows once held up to 4 MiB of edge blocks each, twice an 8 MiB window."""
    from ragckpt.storage.direct import ThreadBuffers

    g = torch.Generator().manual_seed(2)
    x = torch.randn(3 << 20, generator=g)  # 12 MiB
    ragckpt.write_global({"x": x}, str(tmp_path / "a"), world_size=3, layout="ragged")
    ragckpt.write_global({"x": x}, str(tmp_path / "b"), world_size=5, layout="element")
    held: dict[tuple[int, int], int] = {}
    lock = threading.Lock()
    real = ThreadBuffers.take

    def spying(self, nbytes):
        with lock:
            key = (id(self), threading.get_ident())
            held[key] = max(held.get(key, 0), int(nbytes))
        return real(self, nbytes)

    monkeypatch.setattr(ThreadBuffers, "take", spying)
    window = 8 << 20
    assert compare(str(tmp_path / "a"), str(tmp_path / "b"), window_bytes=window, workers=8).ok
    assert sum(held.values()) <= window, (sum(held.values()) >> 10, len(held))


def test_name_globs_select_and_an_unmatched_glob_is_an_error(tmp_path, state):
    ragckpt.write_global(state, str(tmp_path / "a"), world_size=2, layout="ragged")
    other = dict(state)
    other["big"] = _flip_bits(state["big"], 5)
    ragckpt.write_global(other, str(tmp_path / "b"), world_size=2, layout="ragged")
    assert not compare(str(tmp_path / "a"), str(tmp_path / "b")).ok
    rep = compare(str(tmp_path / "a"), str(tmp_path / "b"), names=["t*"])
    assert rep.ok and rep.compared == sum(n.startswith("t") for n in state) == 10
    with pytest.raises(UnknownNameError, match="matches 'nope\\*'"):
        compare(str(tmp_path / "a"), str(tmp_path / "b"), names=["nope*"])
    # one typo among several globs: 'big' (which differs) would silently go uncompared
    with pytest.raises(UnknownNameError, match="matches 'bgi'; "):
        compare(str(tmp_path / "a"), str(tmp_path / "b"), names=["t*", "bgi"])
    assert not compare(str(tmp_path / "a"), str(tmp_path / "b"), names=["t*", "big"]).ok


def test_damaged_object_raises_rather_than_counting_as_a_difference(tmp_path):
    t = torch.randn(64, 64)
    ragckpt.write_global({"w": t}, str(tmp_path / "a"), world_size=2, layout="row")
    ragckpt.write_global({"w": t}, str(tmp_path / "b"), world_size=2, layout="row")
    f = tmp_path / "b" / "buffers" / "0" / "c.1.0"
    raw = bytearray(f.read_bytes())
    raw[10] ^= 0x40
    f.write_bytes(bytes(raw))
    with pytest.raises(IntegrityError, match=r"c\.1\.0"):
        compare(str(tmp_path / "a"), str(tmp_path / "b"))


def test_cli_diff_exit_codes_text_and_json(tmp_path, state):
    a, b, c = (str(tmp_path / n) for n in "abc")
    ragckpt.write_global(state, a, world_size=8, layout="ragged")
    ragckpt.reshard.reshard(a, b, 3, layout="row")
    code, out, err = cli_run("diff", a, b)
    assert code == 0 and out.startswith("identical;") and err == "", (code, out, err)
    other = dict(state)
    other["big"] = _flip_bits(state["big"], 40, mask=0x80)
    ragckpt.write_global(other, c, world_size=2, layout="element")
    code, out, _ = cli_run("diff", a, c)
    assert code == 1 and "VALUES  big: 1 of 8481 elements differ (first at [1, 7]" in out, out
    code, out, _ = cli_run("diff", a, c, "--json")
    doc = json.loads(out)
    assert code == 1 and doc["identical"] is False
    (d,) = doc["differences"]
    assert d["name"] == "big" and d["differing"] == 1 and d["first_index"] == [1, 7]
    json.dumps(doc, allow_nan=False)  # NaN and infinities are spelled as strings
    assert "no ragckpt checkpoint" in cli_error("diff", a, str(tmp_path / "missing"))
    assert "Example" in cli_run("diff", "--help")[1]


def test_integer_differences_are_exact_at_any_width(tmp_path):
    """64-bit integers above 2**53 lost their low bits in a float64 difference ("largest |a - b| 0"
    for two values one apart); the extremes of int64 and uint64 are 2**64 - 1 apart."""
    big = 1 << 60
    a = {"i64": torch.tensor([big + 1, -(2**63), 5], dtype=torch.int64),
         "u64": torch.tensor([0, 7], dtype=torch.uint64), "i8": torch.tensor([-128, 3], dtype=torch.int8),
         "flag": torch.tensor([True, False])}
    b = {"i64": torch.tensor([big, 2**63 - 1, 5], dtype=torch.int64),
         "u64": torch.tensor([2**64 - 1, 7], dtype=torch.uint64), "i8": torch.tensor([127, 3], dtype=torch.int8),
         "flag": torch.tensor([True, True])}
    ragckpt.write_global(a, str(tmp_path / "a"), world_size=2)
    ragckpt.write_global(b, str(tmp_path / "b"), world_size=3, layout="element")
    got = {d.name: d for d in compare(str(tmp_path / "a"), str(tmp_path / "b")).differences}
    assert got["i64"].differing == 2 and got["i64"].max_abs_diff == 2**64 - 1
    assert got["i64"].first_values == (big + 1, big) and got["u64"].max_abs_diff == 2**64 - 1
    assert got["i8"].max_abs_diff == 255 and got["flag"].max_abs_diff == 1
    one_apart = {"x": torch.tensor([big + 1])}
    ragckpt.write_global(one_apart, str(tmp_path / "c"), world_size=1)
    ragckpt.write_global({"x": torch.tensor([big])}, str(tmp_path / "d"), world_size=1)
    (d,) = compare(str(tmp_path / "c"), str(tmp_path / "d")).differences
    assert d.max_abs_diff == 1 and "largest |a - b| 1)" in d.detail


def test_a_single_glob_string_is_one_pattern(tmp_path):
    ragckpt.write_global({"model.w": torch.ones(3), "optim.step": torch.tensor(1.0)}, str(tmp_path / "a"), 1)
    ragckpt.write_global({"model.w": torch.ones(3), "optim.step": torch.tensor(2.0)}, str(tmp_path / "b"), 1)
    rep = compare(str(tmp_path / "a"), str(tmp_path / "b"), names="model.*")
    assert rep.ok and rep.compared == 1


MEMORY_PROBE = """
import sys
import torch  # imports are not data: compare loads torch on first use (ragckpt.lazy)
from ragckpt.checkpoint.compare import compare
def hwm():  # VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the forking parent
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:"))
base = hwm()
rep = compare(sys.argv[1], sys.argv[2], window_bytes=int(sys.argv[3]), workers=int(sys.argv[5]))
assert rep.differences[0].differing == int(sys.argv[4]), rep.differences
print(hwm() - base)
"""


@pytest.mark.slow
def test_memory_stays_near_the_window_when_every_element_differs(tmp_path):
    """Two 48 MiB fp8 tensors that differ everywhere, compared in a 16 MiB window: the indices and
    float64 differences of every differing element once took about 36 bytes per byte compared."""
    import subprocess
    import sys

    n = 48 << 20
    x = torch.randint(0, 120, (n,), dtype=torch.uint8)
    ragckpt.write_global({"w": x.view(torch.float8_e4m3fn)}, str(tmp_path / "a"), world_size=2)
    ragckpt.write_global({"w": (x + 1).view(torch.float8_e4m3fn)}, str(tmp_path / "b"), world_size=3)
    del x
    window = 16 << 20
    out = subprocess.run([sys.executable, "-c", MEMORY_PROBE, str(tmp_path / "a"), str(tmp_path / "b"), str(window),
                          str(n), "1"], capture_output=True, text=True, timeout=300, check=True)
    grew = int(out.stdout.split()[-1])
    assert grew < window + (24 << 20), f"peak RSS grew {grew >> 20} MiB for a {window >> 20} MiB window"


def test_memory_stays_near_the_window_with_several_threads(tmp_path):
    """128 MiB compared by 4 threads in a 32 MiB window: each thread reads every window into the same
    two buffers. A fresh pair per window went to the threads' malloc arenas, which kept them: the
    peak grew by 88-190 MiB; then by 44-49 MiB while the partial checksum blocks at a window's ends
    were staged in fresh buffers; 30 MiB since they go to a per-thread scratch."""
    import subprocess
    import sys

    g = torch.Generator().manual_seed(5)
    x = torch.randint(-2**31, 2**31 - 1, (32 << 20,), dtype=torch.int32, generator=g)
    ragckpt.write_global({"w": x.view(torch.float32)}, str(tmp_path / "a"), world_size=8, layout="ragged")
    y = x.clone()
    y[::4096] ^= 1  # 8,192 differences, spread over every window
    ragckpt.write_global({"w": y.view(torch.float32)}, str(tmp_path / "b"), world_size=5, layout="row")
    del x, y
    window = 32 << 20
    out = subprocess.run([sys.executable, "-c", MEMORY_PROBE, str(tmp_path / "a"), str(tmp_path / "b"), str(window),
                          str(8192), "4"], capture_output=True, text=True, timeout=300, check=True)
    grew = int(out.stdout.split()[-1])
    assert grew < window + (6 << 20), f"peak RSS grew {grew >> 20} MiB for a {window >> 20} MiB window"


def test_a_window_below_the_minimum_is_refused_not_raised_silently(tmp_path):
    """diff --window 1 used to run in 256 KiB anyway; reshard and verify refuse a window too small.
    The least window counts the checksum blocks each side reads whole at a window's ends."""
    ragckpt.write_global({"x": torch.ones(4)}, str(tmp_path / "a"), world_size=1)  # 1 MiB blocks
    ragckpt.write_global({"x": torch.ones(4)}, str(tmp_path / "b"), world_size=1, block_bytes=4096)
    least = 4 * MIN_WINDOW_BYTES + 2 * (1 << 20) + 2 * 4096
    with pytest.raises(OptionError, match=rf"window of {least - 1} bytes is below the {least} diff needs for these "
                                          r"checkpoints .*blocks at its ends: 1048576 and 4096 bytes\); give --window "
                                          r"2368KiB or more"):
        compare(str(tmp_path / "a"), str(tmp_path / "b"), window_bytes=least - 1)
    assert compare(str(tmp_path / "a"), str(tmp_path / "b"), window_bytes=least).ok
    code, out, err = cli_run("diff", str(tmp_path / "a"), str(tmp_path / "a"), "--window", "1", "--json")
    assert code == 2 and "give --window 4352KiB or more" in json.loads(out)["error"], (out, err)
    code, out, _ = cli_run("diff", str(tmp_path / "a"), str(tmp_path / "a"), "--json")
    doc = json.loads(out)
    assert code == 0 and doc["ok"] is True and doc["identical"] is True  # ok, as verify says it

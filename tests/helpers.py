"""Shared test data builders."""

from __future__ import annotations

import socket

import numpy as np
import torch

ALL_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2,
              torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool, torch.float64]
#: the dtypes added later (tests/format/test_more_dtypes.py); not in ALL_DTYPES, which the rest of the suite uses
MORE_DTYPES = [torch.complex64, torch.complex128, torch.uint16, torch.uint32, torch.uint64]

# (real, imaginary) bit patterns planted at the start of complex tensors: NaN, +-inf and -0.0 in
# either part, and NaNs with a payload and sign (quiet and signalling) that any conversion would lose
_COMPLEX_PARTS = {
    torch.complex64: (np.uint32, [(0x7FC00000, 0xFF800000), (0x80000000, 0x00000000), (0x7F800000, 0x80000000),
                                  (0x00000000, 0xFF800001), (0x7FC0BEEF, 0x3F800000)]),
    torch.complex128: (np.uint64, [(0x7FF8000000000000, 0xFFF0000000000000), (0x8000000000000000, 0),
                                   (0x7FF0000000000000, 0x8000000000000000), (0, 0xFFF0000000000001),
                                   (0x7FF800000000BEEF, 0x3FF0000000000000)]),
}
_UINT_NP = {torch.uint16: np.uint16, torch.uint32: np.uint32, torch.uint64: np.uint64}


def special_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random bits of `dtype`, with NaN, +-inf and -0.0 planted where the dtype has them (in both
    parts of a complex number, with NaN payloads), and the largest unsigned values in uint16/32/64:
    a bit-level comparison then proves nothing was converted on the way."""
    g = torch.Generator().manual_seed(seed)
    n = 1
    for s in shape:
        n *= s
    width = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * width,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        return (raw[:n] & 1).bool().reshape(shape)
    t = raw.view(dtype).clone()
    if dtype.is_floating_point and n >= 4:
        specials = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0])
        if dtype == torch.float8_e4m3fn:
            specials = torch.tensor([float("nan"), 448.0, -448.0, -0.0])
        t[:4] = specials.to(dtype)
    elif dtype in _COMPLEX_PARTS and n >= 1:
        part, pairs = _COMPLEX_PARTS[dtype]
        k = min(n, len(pairs))
        t.view(torch.uint8)[: k * width] = torch.from_numpy(np.array(pairs[:k], dtype=part).reshape(-1).view(np.uint8))
    elif dtype in _UINT_NP and n >= 1:
        # the largest value, then the top bit alone: both above the signed range of the same width
        u = _UINT_NP[dtype]
        k = min(n, 2)
        top = np.array([np.iinfo(u).max, 1 << (width * 8 - 1)], dtype=u)[:k]
        t.view(torch.uint8)[: k * width] = torch.from_numpy(top.view(np.uint8))
    return t.reshape(shape)


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bytes of a tensor, for exact comparison (NaN == NaN, -0.0 != 0.0)."""
    t = t.contiguous().reshape(-1)
    if t.numel() == 0:
        return torch.zeros(0, dtype=torch.uint8)
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    return t.view(torch.uint8)


def assert_bit_equal(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert tuple(got.shape) == tuple(want.shape), f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert torch.equal(bits(got), bits(want)), f"{what}: bytes differ"


def odd_state(dtype_cycle=ALL_DTYPES, seed: int = 0) -> dict[str, torch.Tensor]:
    """Primes, 1-element, 0-element, 0-d, rows < W: the shapes that break sharding code."""
    shapes = [(13, 7), (1,), (0,), (), (3, 5), (2, 0, 3), (17,), (5, 3, 2), (1, 1), (31, 2)]
    state = {}
    for i, shape in enumerate(shapes):
        dt = dtype_cycle[i % len(dtype_cycle)]
        state[f"t{i}.{str(dt).split('.')[-1]}"] = special_tensor(shape, dt, seed + i)
    return state


def fill_failing_at(call: int, failure: BaseException):
    """A 4-rank row layout of one 4096-element float32 tensor and a `write_streaming` fill_for
    whose chunk source raises `failure` on its `call`-th chunk (zeros otherwise): a writer that
    fails, or is interrupted, half way through."""
    import ragckpt

    lay = ragckpt.CheckpointLayout.build({"v": ((4096,), "float32")}, 4, "row")
    data = torch.zeros(4096).view(torch.uint8).numpy().data
    calls: list[int] = []

    def fill_for(bi: int, r: int):
        def fill(lo: int, hi: int):
            calls.append(r)
            if len(calls) == call:
                raise failure
            return data[r * 4096 + lo * 4 : r * 4096 + hi * 4]
        return fill

    return lay, fill_for


def cut(total: int, sizes: list[int]) -> list[memoryview]:
    """Consecutive writable views of the given sizes over one fresh buffer of `total` bytes."""
    buf = memoryview(bytearray(total))
    out, p = [], 0
    for n in sizes:
        out.append(buf[p : p + n])
        p += n
    assert p == total
    return out


def spy_read_sizes(monkeypatch, store_cls: type) -> list[int]:
    """The size of every `read_range_pieces` buffer of `store_cls` from now on (verify's streaming
    reads), in a list that fills as they happen."""
    sizes: list[int] = []
    real = store_cls.read_range_pieces

    def spy(self, key, start, out, piece_bytes):
        sizes.append(len(out))
        return real(self, key, start, out, piece_bytes)

    monkeypatch.setattr(store_cls, "read_range_pieces", spy)
    return sizes


def cli_run(*args: str) -> tuple[int, str, str]:
    """Run the `ragckpt` command in this process: (exit code, stdout, stderr)."""
    from click.testing import CliRunner

    from cli.main import cli

    r = CliRunner().invoke(cli, list(args))
    return r.exit_code, r.stdout, r.stderr


def cli_error(*args: str) -> str:
    """Run a command that must fail as bad input does: exit code 2, exactly one `error: ` line on
    stderr, no traceback. Returns that line."""
    code, out, err = cli_run(*args)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, (code, out, err)
    return lines[0]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a gloo rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

# ruff: noqa: E741 - `l` is a layout index, as FORMAT.md names it (`meta/units/<l>`)
"""A clean-room reader of checkpoint format v1, written from docs/FORMAT.md, docs/STORAGE.md and
README.md alone by someone who had not read the code; it never imports ragckpt. test_format_spec.py
runs it against what ragckpt writes, so the spec and the code cannot drift apart unnoticed.

Usage:  python tests/spec_reader.py CKPT [--no-verify] [--json]

Library: SpecReader(path) -> .committed, .commit_problems, .names(), .meta(name),
         .read(name), .read_local(name, rank), .verify() -> list of problems,
         .extra(rank) -> (tensors, strings), .user
"""
from __future__ import annotations

import json
import math
import os
import struct
import sys

import numpy as np
import torch
import zarr
from awscrt.checksums import crc32c  # not ragckpt's wrapper: the library itself

LOGICAL = {  # logical dtype -> (torch dtype, storage numpy dtype)
    "float64": (torch.float64, np.float64), "float32": (torch.float32, np.float32),
    "float16": (torch.float16, np.float16), "int64": (torch.int64, np.int64),
    "int32": (torch.int32, np.int32), "int16": (torch.int16, np.int16),
    "int8": (torch.int8, np.int8), "uint8": (torch.uint8, np.uint8), "bool": (torch.bool, np.bool_),
    "bfloat16": (torch.bfloat16, np.uint16), "float8_e4m3fn": (torch.float8_e4m3fn, np.uint8),
    "float8_e5m2": (torch.float8_e5m2, np.uint8),
    "complex64": (torch.complex64, np.complex64), "complex128": (torch.complex128, np.complex128),
    "uint16": (torch.uint16, np.uint16), "uint32": (torch.uint32, np.uint32), "uint64": (torch.uint64, np.uint64),
}
#: FORMAT.md section 4: the buffer arrays' attribute note, verbatim
BUFFER_NOTE = "row r holds rank r's flat buffer; its length is in the root manifest"
STORAGE_NAME = {"bfloat16": "uint16", "float8_e4m3fn": "uint8", "float8_e5m2": "uint8"}
#: FORMAT.md section 4: a buffer array's fill value where it is not 0
FILL = {"bool": False, "complex64": [0.0, 0.0], "complex128": [0.0, 0.0]}


def _prod(xs):
    p = 1
    for x in xs:
        p *= int(x)
    return p


def to_torch(arr: np.ndarray, logical: str) -> torch.Tensor:
    tdt, sdt = LOGICAL[logical]
    arr = np.ascontiguousarray(arr, dtype=sdt)
    t = torch.from_numpy(arr.copy())
    return t.view(tdt) if t.dtype != tdt else t


def parse_safetensors(blob: bytes):
    """Hand-written safetensors parser (format: u64 LE header len, JSON header, data)."""
    st_dt = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
             "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
             "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "C64": "complex64", "U16": "uint16",
             "U32": "uint32", "U64": "uint64"}
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    base = 8 + n
    meta = header.pop("__metadata__", None) or {}
    out = {}
    for k, v in header.items():
        a, b = v["data_offsets"]
        logical = st_dt[v["dtype"]]
        sdt = LOGICAL[logical][1]
        arr = np.frombuffer(blob[base + a: base + b], dtype=np.dtype(sdt).newbyteorder("<"))
        out[k] = to_torch(arr.reshape(v["shape"]), logical)
    return out, meta


class SpecReader:
    def __init__(self, path: str):
        self.path = path.rstrip("/")
        with open(self._p("zarr.json"), "rb") as f:
            self.root_bytes = f.read()
        root = json.loads(self.root_bytes)
        self.m = root["attributes"]["ragckpt"]
        m = self.m
        assert m["format"] == "ragckpt" and m["format_version"] == 1, (m.get("format"), m.get("format_version"))
        self.W = int(m["world_size"])
        self.block_bytes = int(m["block_bytes"])
        self.max_chunk_bytes = int(m["max_chunk_bytes"])
        self.user = m.get("user")
        self._units = {}
        # name -> (b, slot)
        self.index = {}
        for b, buf in enumerate(m["buffers"]):
            for i, n in enumerate(buf["tensors"]):
                assert n not in self.index, f"duplicate tensor name {n}"
                self.index[n] = (b, i)
        self.committed, self.commit_problems, self.marker = self._check_committed()

    # ---- paths
    def _p(self, key):
        return os.path.join(self.path, key)

    def _exists(self, key):
        return os.path.exists(self._p(key))

    def _read(self, key):
        with open(self._p(key), "rb") as f:
            return f.read()

    # ---- commit state (section 4/5)
    def _check_committed(self):
        problems = []
        if not self._exists("COMMITTED"):
            return False, ["no COMMITTED marker"], None
        try:
            marker = json.loads(self._read("COMMITTED"))
        except Exception as e:  # noqa: BLE001
            return False, [f"COMMITTED is not JSON: {e}"], None
        for k in ("format", "format_version", "world_size", "committed_at", "total_bytes", "objects_crc32c"):
            if k not in marker:
                problems.append(f"COMMITTED lacks {k!r}")
        if marker.get("format") != "ragckpt":
            problems.append(f"COMMITTED format {marker.get('format')!r}")
        if marker.get("format_version") != 1:
            problems.append(f"COMMITTED format_version {marker.get('format_version')!r}")
        if marker.get("world_size") != self.W:
            problems.append(f"COMMITTED world_size {marker.get('world_size')} != manifest {self.W}")
        return not problems, problems, marker

    # ---- layout math (section 1)
    def layout(self, l):
        return self.m["layouts"][l]

    def units_table(self, l):
        if l not in self._units:
            L = self.layout(l)
            T = len(L["shapes"])
            spec = L["units"]
            a = zarr.open_array(self._p(spec["array"]), mode="r")
            U = np.asarray(a[...], dtype=np.int64)
            assert list(U.shape) == list(spec["shape"]) == [T, self.W], (U.shape, spec["shape"], T, self.W)
            self._units[l] = U
        return self._units[l]

    def row_size(self, shape, d):
        return _prod(shape[d:])  # d == 0: numel

    def rank_sizes(self, l):
        """S_r in elements for each rank."""
        L = self.layout(l)
        if L["family"] == "flat":
            return [int(L["shard_size"])] * self.W
        U = self.units_table(l)
        R = np.array([self.row_size(s, d) for s, d in zip(L["shapes"], L["dims"], strict=False)], dtype=np.int64)
        return [int((U[:, r] * R).sum()) for r in range(self.W)]

    def expected_chunk(self, b):
        buf = self.m["buffers"][b]
        isz = np.dtype(LOGICAL[buf["dtype"]][1]).itemsize
        Smax = max(self.rank_sizes(buf["layout"])) if self.W else 0
        if Smax == 0:
            return Smax, 1, isz
        if Smax * isz <= self.max_chunk_bytes:
            return Smax, Smax, isz
        unit = math.lcm(self.block_bytes, isz) // isz
        n = -(-(Smax * isz) // self.max_chunk_bytes)
        per = -(-Smax // n)
        C = -(-per // unit) * unit
        return Smax, C, isz

    # ---- tensors (section 6)
    def names(self):
        return list(self.index)

    def meta(self, name):
        b, i = self.index[name]
        buf = self.m["buffers"][b]
        L = self.layout(buf["layout"])
        return {"shape": tuple(L["shapes"][i]), "dtype": buf["dtype"], "buffer": b, "slot": i,
                "layout": buf["layout"], "family": L["family"], "dims": L["dims"][i]}

    def _arr(self, b):
        cache = self.__dict__.setdefault("_arrs", {})
        if b not in cache:
            cache[b] = zarr.open_array(self._p(f"buffers/{b}"), mode="r")
        return cache[b]

    def pieces(self, name):
        """list of (rank, tensor_elem_lo, tensor_elem_hi, buffer_off)."""
        md = self.meta(name)
        shape, i, L = md["shape"], md["slot"], self.layout(md["layout"])
        numel = _prod(shape)
        out = []
        if L["family"] == "flat":
            S, off = int(L["shard_size"]), int(L["offsets"][i])
            if numel == 0:
                return out
            for k in range(off // S, (off + numel - 1) // S + 1):
                lo, hi = max(off, k * S), min(off + numel, (k + 1) * S)
                out.append((k, lo - off, hi - off, lo - k * S))
        elif L["family"] == "per_tensor":
            U = self.units_table(md["layout"])
            R = np.array([self.row_size(s, d) for s, d in zip(L["shapes"], L["dims"], strict=False)], dtype=np.int64)
            E = U * R[:, None]
            assert int(E[i].sum()) == numel, f"{name}: units*R sum {int(E[i].sum())} != numel {numel}"
            for r in range(self.W):
                lo = int(E[i, :r].sum())
                hi = lo + int(E[i, r])
                if hi > lo:
                    out.append((r, lo, hi, int(E[:i, r].sum())))
        else:
            raise ValueError(f"unknown family {L['family']}")
        return out

    def read(self, name):
        md = self.meta(name)
        numel = _prod(md["shape"])
        sdt = LOGICAL[md["dtype"]][1]
        flat = np.zeros(numel, dtype=sdt)
        a = self._arr(md["buffer"])
        for r, lo, hi, boff in self.pieces(name):
            flat[lo:hi] = a[r, boff: boff + (hi - lo)]
        return to_torch(flat, md["dtype"]).reshape(md["shape"])

    def read_local(self, name, rank):
        """rank's piece as a flat 1-D tensor plus its (lo, hi) range in the tensor's flat elements."""
        md = self.meta(name)
        a = self._arr(md["buffer"])
        for r, lo, hi, boff in self.pieces(name):
            if r == rank:
                return to_torch(np.asarray(a[r, boff: boff + (hi - lo)]), md["dtype"]), (lo, hi)
        return to_torch(np.zeros(0, LOGICAL[md["dtype"]][1]), md["dtype"]), (0, 0)

    def read_rank_buffer(self, b, rank):
        buf = self.m["buffers"][b]
        S_r = self.rank_sizes(buf["layout"])[rank]
        return np.asarray(self._arr(b)[rank, :S_r])

    # ---- extras
    def extra(self, rank):
        key = f"extra/{rank}.safetensors"
        if not self._exists(key):
            return None
        return parse_safetensors(self._read(key))

    # ---- integrity (section 4)
    def array_doc(self, shape, chunks, dtype, sep, fill, codecs, attributes):
        return {"attributes": attributes, "chunk_grid": {"configuration": {"chunk_shape": list(chunks)}, "name": "regular"},
                "chunk_key_encoding": {"configuration": {"separator": sep}, "name": "default"},
                "codecs": codecs, "data_type": dtype, "dimension_names": None, "fill_value": fill,
                "node_type": "array", "shape": list(shape), "storage_transformers": [], "zarr_format": 3}

    def verify(self, check_docs=True):
        probs = []
        if not self.committed:
            probs += self.commit_problems
        m = self.m
        bytes_codec = {"configuration": {"endian": "little"}, "name": "bytes"}
        zstd = {"configuration": {"checksum": False, "level": 3}, "name": "zstd"}
        crc_objs = {"zarr.json": crc32c(self.root_bytes)}
        # tables: units
        for l, L in enumerate(m["layouts"]):
            if L["family"] == "per_tensor":
                T = len(L["shapes"])
                key = L["units"]["array"]
                if key != f"meta/units/{l}":
                    probs.append(f"layout {l}: units array at {key!r}, spec says meta/units/{l}")
                if check_docs:
                    want = self.array_doc((T, self.W), (T, self.W), "int64", "/", 0, [bytes_codec, zstd], {})
                    probs += self._cmp_doc(f"{key}/zarr.json", want)
                if self._exists(f"{key}/c/0/0"):
                    crc_objs[f"{key}/c/0/0"] = crc32c(self._read(f"{key}/c/0/0"))
        total_bytes = 0
        for b, buf in enumerate(m["buffers"]):
            logical = buf["dtype"]
            if buf.get("storage_dtype") != STORAGE_NAME.get(logical, logical):
                probs.append(f"buffer {b}: storage_dtype {buf.get('storage_dtype')} for {logical}")
            Smax, C, isz = self.expected_chunk(b)
            sizes = self.rank_sizes(buf["layout"])
            a = self._arr(b)
            zdoc = json.loads(self._read(f"buffers/{b}/zarr.json"))
            if a.shape != (self.W, Smax):
                probs.append(f"buffer {b}: shape {a.shape} != {(self.W, Smax)}")
            if tuple(a.chunks) != (1, C):
                probs.append(f"buffer {b}: chunks {a.chunks} != {(1, C)}")
            if zdoc["data_type"] != STORAGE_NAME.get(logical, logical):
                probs.append(f"buffer {b}: data_type {zdoc['data_type']}")
            if zdoc["chunk_key_encoding"] != {"configuration": {"separator": "."}, "name": "default"}:
                probs.append(f"buffer {b}: key encoding {zdoc['chunk_key_encoding']}")
            fill = FILL.get(logical, 0)
            if zdoc["fill_value"] != fill:
                probs.append(f"buffer {b}: fill_value {zdoc['fill_value']!r}")
            if zdoc["codecs"] != [bytes_codec]:
                probs.append(f"buffer {b}: codecs {zdoc['codecs']}")
            at = zdoc.get("attributes", {}).get("ragckpt", {})
            if at.get("buffer") != buf["name"] or at.get("dtype") != logical:
                probs.append(f"buffer {b}: attributes {zdoc.get('attributes')}")
            if check_docs:
                want = self.array_doc((self.W, Smax), (1, C), STORAGE_NAME.get(logical, logical), ".", fill,
                                      [bytes_codec],
                                      {"ragckpt": {"buffer": buf["name"], "dtype": logical, "note": BUFFER_NOTE}})
                probs += self._cmp_doc(f"buffers/{b}/zarr.json", want)
            if C < Smax and (C * isz) % self.block_bytes:
                probs.append(f"buffer {b}: chunk bytes {C * isz} not a multiple of block_bytes (block straddles objects)")
            nblocks = [-(-(s * isz) // self.block_bytes) for s in sizes]
            total_blocks = sum(nblocks)
            ckey = f"meta/crc/{b}"
            crc = None
            if check_docs:
                want = self.array_doc((total_blocks,), (max(total_blocks, 1),), "uint32", "/", 0, [bytes_codec], {})
                probs += self._cmp_doc(f"{ckey}/zarr.json", want)
            if not self._exists(f"{ckey}/zarr.json"):
                probs.append(f"{ckey} missing")
            else:
                crc = np.asarray(zarr.open_array(self._p(ckey), mode="r")[...], dtype=np.uint32)
                if crc.shape != (total_blocks,):
                    probs.append(f"{ckey}: shape {crc.shape} != ({total_blocks},)")
                    crc = None
                if self._exists(f"{ckey}/c/0"):
                    crc_objs[f"{ckey}/c/0"] = crc32c(self._read(f"{ckey}/c/0"))
            start = 0
            for r, S_r in enumerate(sizes):
                nb = S_r * isz
                total_bytes += nb
                # raw objects: sizes and edge padding
                nch = -(-S_r // C) if S_r else 0
                raw = bytearray()
                for j in range(nch):
                    key = f"buffers/{b}/c.{r}.{j}"
                    if not self._exists(key):
                        probs.append(f"{key} missing")
                        raw += bytes(C * isz)
                        continue
                    data = self._read(key)
                    if len(data) != C * isz:
                        probs.append(f"{key}: {len(data)} bytes, expected {C * isz}")
                    raw += data
                # stray chunks past S_r
                for j in range(nch, nch + 2):
                    if self._exists(f"buffers/{b}/c.{r}.{j}"):
                        probs.append(f"buffers/{b}/c.{r}.{j}: chunk past S_r exists")
                if bytes(raw[nb:]).strip(b"\0"):
                    probs.append(f"buffer {b} rank {r}: edge padding not zero")
                # also compare with plain zarr read
                zb = np.ascontiguousarray(self.read_rank_buffer(b, r)).tobytes()
                if zb != bytes(raw[:nb]):
                    probs.append(f"buffer {b} rank {r}: zarr read differs from raw objects")
                if crc is not None:
                    for k in range(nblocks[r]):
                        blk = zb[k * self.block_bytes: (k + 1) * self.block_bytes]
                        if crc32c(blk) != int(crc[start + k]):
                            probs.append(f"buffer {b} rank {r} block {k}: crc32c mismatch "
                                         f"({crc32c(blk):#010x} != {int(crc[start + k]):#010x})")
                start += nblocks[r]
        # extras
        ekey = "meta/extra"
        if check_docs:
            probs += self._cmp_doc(f"{ekey}/zarr.json",
                                   self.array_doc((self.W, 2), (self.W, 2), "int64", "/", 0, [bytes_codec], {}))
        if self._exists(f"{ekey}/zarr.json"):
            E = np.asarray(zarr.open_array(self._p(ekey), mode="r")[...], dtype=np.int64)
            if self._exists(f"{ekey}/c/0/0"):
                crc_objs[f"{ekey}/c/0/0"] = crc32c(self._read(f"{ekey}/c/0/0"))
            for r in range(self.W):
                key = f"extra/{r}.safetensors"
                if E[r, 0] == -1:
                    if E[r, 1] != -1:
                        probs.append(f"meta/extra rank {r}: size -1 crc {E[r, 1]}")
                    if self._exists(key):
                        probs.append(f"{key} exists but meta/extra says none")
                    continue
                if not self._exists(key):
                    probs.append(f"{key} missing")
                    continue
                data = self._read(key)
                if len(data) != E[r, 0]:
                    probs.append(f"{key}: size {len(data)} != {E[r, 0]}")
                if crc32c(data) != E[r, 1]:
                    probs.append(f"{key}: crc mismatch")
        else:
            probs.append("meta/extra missing")
        # COMMITTED
        if self.marker is not None:
            if self.marker.get("total_bytes") != total_bytes:
                probs.append(f"COMMITTED total_bytes {self.marker.get('total_bytes')} != {total_bytes}")
            oc = self.marker.get("objects_crc32c")
            if not isinstance(oc, dict):
                probs.append(f"objects_crc32c is {type(oc).__name__}, reader expects a key->crc dict")
            else:
                for k, v in oc.items():
                    if v == 0 and k not in crc_objs:
                        continue  # legacy empty-table entry
                    if k not in crc_objs:
                        if self._exists(k):
                            crc_objs[k] = crc32c(self._read(k))
                        else:
                            probs.append(f"objects_crc32c lists {k!r}, which does not exist")
                            continue
                    if crc_objs[k] != v:
                        probs.append(f"objects_crc32c {k}: {v:#x} != actual {crc_objs[k]:#x}")
                for k in crc_objs:
                    if k not in oc:
                        probs.append(f"objects_crc32c lacks {k}")
        return probs


    # ---- structural invariants of sections 1 and 3 (not checksums)
    def structure(self):
        probs = []
        m = self.m
        kind = m["layout"]
        fams = {L["family"] for L in m["layouts"]}
        want = {"ragged": {"flat"}, "element": {"flat"}, "row": {"per_tensor"}}.get(kind)
        if want is not None and fams - want:
            probs.append(f"layout kind {kind} but families {fams}")
        for l, L in enumerate(m["layouts"]):
            shapes, dims = L["shapes"], L["dims"]
            if len(dims) != len(shapes):
                probs.append(f"layout {l}: {len(dims)} dims for {len(shapes)} shapes")
            for t, (s, d) in enumerate(zip(shapes, dims, strict=False)):
                if not 0 <= d <= len(s):
                    probs.append(f"layout {l} slot {t}: dims {d} for shape {s}")
                if kind == "element" and d != len(s):
                    probs.append(f"layout {l} slot {t}: element layout with dims {d} != ndim {len(s)}")
                if kind == "row" and d != min(1, len(s)):
                    probs.append(f"layout {l} slot {t}: row layout with dims {d} for shape {s}")
            if L["family"] == "flat":
                S = int(L["shard_size"])
                ivs = []
                for t, (s, d, off) in enumerate(zip(shapes, dims, L["offsets"], strict=False)):
                    n, R = _prod(s), self.row_size(s, d)
                    if off < 0 or off + n > self.W * S:
                        probs.append(f"layout {l} slot {t}: [{off},{off + n}) outside W*S={self.W * S}")
                    if n:
                        ivs.append((off, off + n, t))
                        for k in range(off // S + 1, (off + n - 1) // S + 1):
                            if (k * S - off) % R:
                                probs.append(f"layout {l} slot {t}: rank boundary {k} cuts a row (R={R})")
                ivs.sort()
                for (_a0, a1, ta), (b0, _b1, tb) in zip(ivs, ivs[1:], strict=False):
                    if b0 < a1:
                        probs.append(f"layout {l}: slots {ta} and {tb} overlap")
            else:
                U = self.units_table(l)
                if (U < 0).any():
                    probs.append(f"layout {l}: negative units")
                for t, (s, d) in enumerate(zip(shapes, dims, strict=False)):
                    n, R = _prod(s), self.row_size(s, d)
                    if n == 0 and int(U[t].sum()) * R:
                        probs.append(f"layout {l} slot {t}: zero-size tensor {s} with units {U[t].tolist()[:8]}{'...' if self.W > 8 else ''}")
                    if n and int(U[t].sum()) * R != n:
                        probs.append(f"layout {l} slot {t}: units sum {int(U[t].sum())} * R {R} != numel {n}")
                    if kind == "row" and n and len(s) >= 1:
                        rows = s[0]
                        ch = [len(c) for c in torch.arange(rows).chunk(self.W)]
                        ch += [0] * (self.W - len(ch))
                        if U[t].tolist() != ch:
                            probs.append(f"layout {l} slot {t}: units {U[t].tolist()[:8]} != torch.chunk {ch[:8]}")
        # layout padding is zero (flat family)
        for b, buf in enumerate(m["buffers"]):
            L = self.layout(buf["layout"])
            if L["family"] != "flat":
                continue
            S = int(L["shard_size"])
            cov = np.zeros(self.W * S, dtype=bool)
            for s, off in zip(L["shapes"], L["offsets"], strict=False):
                cov[off: off + _prod(s)] = True
            if cov.all():
                continue
            a = np.asarray(self._arr(b)[...]).reshape(-1)[: self.W * S] if S else np.zeros(0)
            if a.view(np.uint8).size and np.asarray(a[~cov]).view(np.uint8).any():
                probs.append(f"buffer {b}: layout padding not zero")
        return probs

    def fingerprint(self):
        import hashlib
        m = self.m
        keys = ("world_size", "layout", "block_bytes", "max_chunk_bytes", "layouts", "buffers", "save_id")
        h = hashlib.sha256(json.dumps({k: m.get(k) for k in keys}, sort_keys=True).encode())
        for l, L in enumerate(m["layouts"]):
            if L["family"] == "per_tensor":
                h.update(np.ascontiguousarray(self.units_table(l), dtype="<i8").tobytes())
        return h.hexdigest()[:32]

    def check_rank_records(self):
        """ranks/<r>.json are not for readers, but they must agree with the consolidated tables."""
        probs = []
        fp = self.fingerprint()
        for r in range(self.W):
            key = f"ranks/{r}.json"
            if not self._exists(key):
                probs.append(f"{key} missing")
                continue
            rec = json.loads(self._read(key))
            if rec.get("rank") != r:
                probs.append(f"{key}: rank {rec.get('rank')}")
            if rec.get("layout_fingerprint") != fp:
                probs.append(f"{key}: fingerprint {rec.get('layout_fingerprint')} != spec's {fp}")
            for b, buf in enumerate(self.m["buffers"]):
                isz = np.dtype(LOGICAL[buf["dtype"]][1]).itemsize
                S_r = self.rank_sizes(buf["layout"])[r]
                e = rec["buffers"].get(str(b))
                if e is None or e["nbytes"] != S_r * isz:
                    probs.append(f"{key}: buffer {b} record {e and e['nbytes']} != {S_r * isz}")
        return probs

    def _cmp_doc(self, key, want):
        if not self._exists(key):
            return [f"{key} missing"]
        got = self._read(key)
        w = json.dumps(want, indent=1, sort_keys=True).encode()
        if got != w:
            try:
                g = json.loads(got)
            except Exception:  # noqa: BLE001
                return [f"{key}: not JSON"]
            diff = {k: (g.get(k), want.get(k)) for k in set(g) | set(want) if g.get(k) != want.get(k)}
            if not diff:
                return [f"{key}: same content, different bytes ({got[:60]!r} vs {w[:60]!r})"]
            return [f"{key}: differs from spec regeneration: {diff}"]
        return []


def main(argv):
    import argparse
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt")
    ap.add_argument("--no-verify", action="store_true")
    args = ap.parse_args(argv)
    r = SpecReader(args.ckpt)
    print(f"world_size={r.W} layout={r.m['layout']} committed={r.committed} {r.commit_problems if not r.committed else ''}")
    for n in r.names():
        md = r.meta(n)
        print(f"  {n}: shape={list(md['shape'])} dtype={md['dtype']} family={md['family']} dims={md['dims']}")
    print("user:", json.dumps(r.user)[:300])
    if not args.no_verify:
        p = r.verify()
        print("verify:", "OK" if not p else "\n  " + "\n  ".join(p))
    assert "ragckpt" not in sys.modules
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Token batches for `ragfsdp.train`, addressed by one integer: the data position.

The position counts the samples the job has consumed. Step s's global batch is samples
`[position, position + batch_size)` whatever the world size, rank r taking its contiguous
`batch_size / world_size` of them, so a run at any world size sees the same data, and a checkpoint
that stores the position (a plain integer) resumes on exactly the batch an uninterrupted run would
have seen next. Each sample is `seq_len + 1` tokens: inputs are the first `seq_len`, targets the last.

Sources:

- synthetic (the default): sample i is drawn from its own generator seeded by (seed, i), a random
  walk over token ids whose steps come from four seeded strides, so the next token is one of four
  and a model has something to learn (loss falls from log(vocab) towards log(4));
- a token file (`--data FILE`): one flat sequence of token ids, either a `.npy` array (1-D, any
  integer dtype) or raw little-endian integers with no header (`.bin`, nanoGPT's format: uint16 by
  default, `--data-dtype int32|uint32` for vocabularies past 65,535). Sample i is the `seq_len + 1`
  tokens from offset `(i * seq_len) mod (n_tokens - seq_len)`: consecutive windows overlapping by one
  token, wrapping round at the end. The file is memory-mapped; only the windows read are touched.
"""

from __future__ import annotations

import os

import numpy as np
import torch

RAW_DTYPES = {"uint16": np.uint16, "int32": np.int32, "uint32": np.uint32}
_STRIDES = 4


class DataError(ValueError):
    """The data cannot feed this model (unreadable file, too short, token ids past the vocabulary)."""


class SyntheticTokens:
    def __init__(self, vocab_size: int, seq_len: int, seed: int) -> None:
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed
        g = torch.Generator().manual_seed(seed)
        self.strides = torch.randint(1, max(2, vocab_size), (_STRIDES,), generator=g)

    def sample(self, index: int) -> torch.Tensor:
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + index) % (2**63))
        start = torch.randint(0, self.vocab_size, (1,), generator=g)
        picks = torch.randint(0, _STRIDES, (self.seq_len,), generator=g)
        walk = torch.cat([start, start + torch.cumsum(self.strides[picks], 0)])
        return walk % self.vocab_size

    def describe(self) -> str:
        return f"synthetic tokens (seed {self.seed}, vocabulary {self.vocab_size})"


class TokenFile:
    def __init__(self, path: str, vocab_size: int, seq_len: int, raw_dtype: str = "uint16") -> None:
        self.path, self.vocab_size, self.seq_len = path, vocab_size, seq_len
        try:
            if path.endswith(".npy"):
                tokens = np.load(path, mmap_mode="r")
            else:
                if raw_dtype not in RAW_DTYPES:
                    raise DataError(f"unknown raw token dtype {raw_dtype!r}; use one of {', '.join(RAW_DTYPES)}")
                item = np.dtype(RAW_DTYPES[raw_dtype]).itemsize
                size = os.path.getsize(path)
                if size % item:
                    raise DataError(f"{path}: {size} bytes is not a whole number of {raw_dtype} tokens")
                tokens = np.memmap(path, dtype=np.dtype(RAW_DTYPES[raw_dtype]).newbyteorder("<"), mode="r")
        except (OSError, ValueError) as e:
            if isinstance(e, DataError):
                raise
            raise DataError(f"cannot read token file {path}: {e}") from None
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise DataError(f"{path}: expected a 1-D array of integer token ids, got {tokens.dtype} {tokens.shape}")
        if len(tokens) < seq_len + 2:
            raise DataError(f"{path} holds {len(tokens)} tokens; --seq-len {seq_len} needs at least {seq_len + 2}")
        self.tokens = tokens

    def sample(self, index: int) -> torch.Tensor:
        n = len(self.tokens)
        start = (index * self.seq_len) % (n - self.seq_len)
        window = torch.from_numpy(np.array(self.tokens[start:start + self.seq_len + 1], dtype=np.int64))
        bad = (window < 0) | (window >= self.vocab_size)
        if bool(bad.any()):
            at = int(bad.nonzero()[0, 0])
            raise DataError(f"{self.path}: token {int(window[at])} at offset {start + at} is outside the model's "
                            f"vocabulary of {self.vocab_size}")
        return window

    def describe(self) -> str:
        return f"{self.path} ({len(self.tokens):,} tokens of {self.tokens.dtype})"


Source = SyntheticTokens | TokenFile


def open_source(path: str | None, vocab_size: int, seq_len: int, seed: int, raw_dtype: str = "uint16") -> Source:
    """The token file at `path`, or seeded synthetic tokens when `path` is None."""
    if path is None:
        return SyntheticTokens(vocab_size, seq_len, seed)
    return TokenFile(path, vocab_size, seq_len, raw_dtype)


def local_batch(source: Source, position: int, batch_size: int, rank: int, world_size: int) -> torch.Tensor:
    """Rank `rank`'s rows of the global batch at `position`: (batch_size / world_size, seq_len + 1) int64."""
    per_rank = batch_size // world_size
    first = position + rank * per_rank
    return torch.stack([source.sample(first + i) for i in range(per_rank)])

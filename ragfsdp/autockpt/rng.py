"""The random-number state a resumed run needs to draw exactly what the uninterrupted run drew.

Per rank, because every rank has its own generators (dropout masks differ per rank). They come back
only at the same world size: at another one there is no rank to take a given state from, so every
rank is reseeded from the step instead (deterministic, but not the uninterrupted run's draws).
"""

from __future__ import annotations

import torch

CPU_KEY = "rng.torch_cpu"
CUDA_KEY = "rng.torch_cuda"


def capture() -> dict[str, torch.Tensor]:
    """This process's torch CPU generator state and, where CUDA is initialised, the current device's."""
    states = {CPU_KEY: torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states[CUDA_KEY] = torch.cuda.get_rng_state()
    return states


def restore(states: dict[str, torch.Tensor]) -> None:
    """Put back what `capture` took (a CUDA state only where this process uses CUDA)."""
    torch.set_rng_state(states[CPU_KEY].to(torch.uint8))
    if CUDA_KEY in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states[CUDA_KEY].to(torch.uint8))


def reseed(seed: int, step: int, rank: int) -> None:
    """A state for a rank of a new world: different per rank and step, the same on every rerun."""
    value = (int(seed) * 1_000_003 + int(step) * 8_191 + int(rank)) % (1 << 63)
    torch.manual_seed(value)

"""`StateBuffer`: one optimizer state buffer as `ragfsdp.state` puts it into a checkpoint.

Optimizer states live in flat buffers laid out like the parameters they update, so a checkpoint
holds them as ragckpt buffers beside the parameters and they reshard with them at load time.
An optimizer speaks this protocol to `ragfsdp.state` / `ragfsdp.load_state`:

- `checkpoint_buffers() -> list[StateBuffer]`: this rank's state buffers;
- `checkpoint_user() -> dict`: JSON metadata (hyperparameters as ENGINE.md describes);
- `after_load(ck: ragckpt.Checkpoint | None)`: called once the buffers were filled from `ck`, or
  with None when the checkpoint holds no optimizer state (the optimizer starts fresh).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

import ragckpt


class StateBuffer(NamedTuple):
    """`local` is this rank's part of buffer `name`. With `like` set (a parameter group's
    `buffer_name`) it has that group's layout element for element and `tensors` are named in the
    same order as the group's parameters; otherwise `layout` is the buffer's own FlatLayout."""

    name: str
    dtype: str
    like: str | None
    layout: ragckpt.FlatLayout | None
    tensors: tuple[str, ...]
    local: torch.Tensor

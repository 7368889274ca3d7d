"""torch, imported the first time it is used.

Reading, verifying, writing and resharding checkpoint bytes takes numpy only; torch comes in where
a tensor is made or checked. Importing torch takes about a second, which was most of every `ragckpt`
command's start-up and of every reshard worker process's (an 8192 -> 4096 reshard of 1 GiB spent a
fifth of its time starting its two workers). Modules on those paths name torch through `torch`
below, an object that imports it on the first attribute asked of it:

    from typing import TYPE_CHECKING
    if TYPE_CHECKING:
        import torch
    else:
        from ragckpt.lazy import torch

Type checkers see the real module; at run time nothing imports torch until a tensor is involved.
Module-level code must not touch it (build dtype tables on first use instead):
`tests/api/test_import_cost.py` checks that importing ragckpt and its CLI, and a whole reshard, never do.
"""

from __future__ import annotations

import importlib
from typing import Any


class _Torch:
    """Stands for the torch module; each attribute is looked up once, then kept on this object."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # copy, pickle and introspection probes: not torch's attributes
            raise AttributeError(name)
        value = getattr(importlib.import_module("torch"), name)
        setattr(self, name, value)
        return value

    def __repr__(self) -> str:
        return "<torch, imported on first use>"


torch: Any = _Torch()

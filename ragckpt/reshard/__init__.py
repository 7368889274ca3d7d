"""Resharding: any layout, any world size, offline (`reshard`) and at load time (`load`).

`ragckpt.reshard` is both this package and a function: calling the module runs
`ragckpt.reshard.offline.reshard`, so `ragckpt.reshard(src, dst, 4096)` works while submodules stay
importable as `ragckpt.reshard.plan` and friends (a plain function export would shadow them).
"""

from __future__ import annotations

import sys
import types
from typing import Any

from ragckpt.reshard.load import load
from ragckpt.reshard.offline import ReshardError, ReshardStats, reshard
from ragckpt.reshard.plan import SourceIndex, rank_plan, target_layout

__all__ = ["ReshardError", "ReshardStats", "SourceIndex", "load", "rank_plan", "reshard", "target_layout"]


class _CallableModule(types.ModuleType):
    def __call__(self, *args: Any, **kwargs: Any) -> ReshardStats:
        return reshard(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

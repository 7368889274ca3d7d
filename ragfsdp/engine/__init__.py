"""The FSDP engine: `fully_shard` units whose parameters live in RaggedShard flat buffers."""

from ragfsdp.engine.api import (
    flat_groups,
    fully_shard,
    no_sync,
    plan_unit,
    reset_stats,
    set_requires_gradient_sync,
    stats,
)
from ragfsdp.engine.clip import clip_grad_norm_
from ragfsdp.engine.flat_group import FlatGroup, Piece
from ragfsdp.engine.mixed_precision import MixedPrecisionPolicy

__all__ = ["FlatGroup", "MixedPrecisionPolicy", "Piece", "clip_grad_norm_", "flat_groups", "fully_shard",
           "no_sync", "plan_unit", "reset_stats", "set_requires_gradient_sync", "stats"]

"""Resharding: any layout, any world size, offline (`ragckpt.reshard.reshard`) and at load time
(`ragckpt.load`)."""

from __future__ import annotations

from ragckpt.reshard.load import load
from ragckpt.reshard.offline import ReshardStats, reshard
from ragckpt.reshard.plan import SourceIndex, rank_plan, target_layout
from ragckpt.reshard.share import ReshardError

__all__ = ["ReshardError", "ReshardStats", "SourceIndex", "load", "rank_plan", "reshard", "target_layout"]

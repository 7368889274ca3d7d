"""Optimizers that update `ragfsdp` flat shards in place, with their state in flat buffers."""

from ragfsdp.optim.adam8bit import Adam8bit
from ragfsdp.optim.adamw import AdamW
from ragfsdp.optim.base import FlatOptimizer
from ragfsdp.optim.muon import Muon
from ragfsdp.optim.state_buffer import StateBuffer

__all__ = ["Adam8bit", "AdamW", "FlatOptimizer", "Muon", "StateBuffer"]

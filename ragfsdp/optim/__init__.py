"""Optimizers that update `ragfsdp` flat shards in place, with their state in flat buffers."""

from ragfsdp.optim.state_buffer import StateBuffer

__all__ = ["StateBuffer"]

"""Auto-checkpointing: periodic background saves, retention, resume and elastic restart."""

from ragfsdp.autockpt.checkpointer import Checkpointer, CheckpointSaveError
from ragfsdp.autockpt.export import export_hf

__all__ = ["CheckpointSaveError", "Checkpointer", "export_hf"]

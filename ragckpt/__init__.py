"""ragckpt: checkpoints and resharding for RaggedShard-sharded training.

The RaggedShard placement is the contract: the same description is the in-memory layout of the
training engine and the on-disk layout of a checkpoint, so saving is a straight write of each rank's
flat buffer and resharding is interval arithmetic on flat element ranges.
"""

from ragckpt import reshard  # noqa: E402  (package; offline resharding is ragckpt.reshard.reshard)
from ragckpt.checkpoint.background import StagingBuffers, save_shard_async  # noqa: E402
from ragckpt.checkpoint.catalog import (  # noqa: E402
    NothingThereError,
    latest_committed,
    list_checkpoints,
    remove_checkpoint,
    save_claim,
    step_of,
)
from ragckpt.checkpoint.compare import CompareReport, compare  # noqa: E402
from ragckpt.checkpoint.reader import Checkpoint, TensorMeta, VerifyReport, open  # noqa: E402,A004
from ragckpt.checkpoint.writer import commit, save_shard, write_global  # noqa: E402
from ragckpt.convert.hf_export import export_hf  # noqa: E402
from ragckpt.convert.hf_import import import_hf  # noqa: E402
from ragckpt.errors import (  # noqa: E402
    BadObjectError,
    DestinationError,
    DestinationExistsError,
    DestinationReplacedError,
    FormatError,
    IntegrityError,
    LayoutError,
    NotCommittedError,
    OptionError,
    OutOfRangeError,
    RagckptError,
    StorageError,
    UnknownNameError,
)
from ragckpt.format.intervals import CopyPlan, copy_plan, flat_range_to_boxes  # noqa: E402
from ragckpt.format.layout import FlatLayout, PerTensorLayout, element_layout, row_layout  # noqa: E402
from ragckpt.format.placement import RaggedShard  # noqa: E402
from ragckpt.planner.planner import plan, plan_layout  # noqa: E402
from ragckpt.planner.state import BufferSpec, CheckpointLayout  # noqa: E402
from ragckpt.reshard.load import load  # noqa: E402
from ragckpt.storage.direct import aligned_empty  # noqa: E402
from ragckpt.version import __version__ as __version__

__all__ = [
    "BadObjectError", "BufferSpec", "Checkpoint", "CheckpointLayout", "CompareReport", "CopyPlan", "DestinationError", "DestinationExistsError", "DestinationReplacedError", "FlatLayout",
    "FormatError", "IntegrityError", "LayoutError", "NotCommittedError", "NothingThereError", "OptionError", "OutOfRangeError", "UnknownNameError", "PerTensorLayout", "RaggedShard",
    "RagckptError", "StagingBuffers", "StorageError", "TensorMeta", "VerifyReport", "aligned_empty", "commit", "compare", "copy_plan", "element_layout",
    "export_hf", "flat_range_to_boxes", "import_hf", "latest_committed", "list_checkpoints", "load", "open", "plan", "plan_layout", "remove_checkpoint", "reshard", "save_claim", "row_layout", "save_shard", "save_shard_async", "step_of",
    "write_global",
]

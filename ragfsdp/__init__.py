"""ragfsdp: an FSDP training engine on RaggedShard flat buffers.

Per `fully_shard` unit and dtype, one flat buffer per rank laid out by `ragckpt.plan_layout` (a
`ragckpt.FlatLayout`): the all-gather and the reduce-scatter run on that buffer directly, the
gathered buffer is the parameters' storage, and a checkpoint save is `ragckpt.save_shard(url,
**ragfsdp.state(model, optimizer))`, a straight write of each rank's buffers. docs/ENGINE.md is the guide.
"""

from ragfsdp import optim  # ragfsdp.optim.AdamW / Muon / Adam8bit after a plain `import ragfsdp`
from ragfsdp.autockpt import Checkpointer, CheckpointSaveError, export_hf  # noqa: E402  (builds on state/load_state)
from ragfsdp.checkpointing import load_state, state
from ragfsdp.engine import (
    FlatGroup,
    MixedPrecisionPolicy,
    Piece,
    clip_grad_norm_,
    flat_groups,
    fully_shard,
    no_sync,
    set_requires_gradient_sync,
)

__all__ = ["CheckpointSaveError", "Checkpointer", "FlatGroup", "MixedPrecisionPolicy", "Piece", "clip_grad_norm_", "export_hf", "flat_groups", "fully_shard",
           "load_state", "no_sync", "optim", "set_requires_gradient_sync", "state"]

"""PyTorch Distributed Checkpoint (DCP) <-> ragckpt, streamed, without a process group.

* `import_dcp(dcp_dir, dst)` reads DCP's `.metadata` (no `torch.distributed` initialisation, no
  pickle code execution) and assembles every rank buffer of the new ragckpt checkpoint chunk by chunk:
  a flat element range of a tensor maps to at most `2d-1` N-D boxes, each box is intersected with the
  saved DCP chunks (boxes) and exactly the overlapping bytes are read from the `.distcp` files
  (`pread` on local files; ranged GETs through ragckpt's stores for `s3://` and other URLs).
  Memory stays at one writer chunk per worker, whatever the checkpoint size.
* `export_dcp(src, out_dir)` writes `.distcp` files and a `.metadata` that stock
  `torch.distributed.checkpoint.load` reads at any world size (it reshards by box overlap). Every
  tensor is cut into row boxes of at most `max_chunk_bytes` (sub-row boxes for rows larger than that),
  each one read with `Checkpoint.read_flat` and serialised exactly as DCP's own writer does
  (`torch.save` of the chunk), so memory stays at one chunk per worker. The directory appears
  atomically (temporary sibling, fsync, rename). Its `.metadata` records the source's world size and
  layout (`ExportRecord`, in `planner_data`, which torch's loaders ignore), so importing an export
  back rebuilds the same shape without flags.

Key mapping (see docs/CONVERT_DCP.md): DCP `model.<fqn>` <-> ragckpt `<fqn>`; `optim.*` keys are
identical on both sides (DCP's flattened optimizer layout is the ragckpt naming convention); any other
tensor key `<k>` <-> `extra.<k>`. Non-tensor DCP entries (optimizer hyperparameters, user objects) are
carried byte for byte in the user metadata (`dcp.bytes`), with a readable per-parameter view under
`optim.param_groups`.

The package, one job per module: `keys` (the key <-> name mapping and the carried non-tensor
entries), `record` (export-dcp's record of its source), `chunks` (a tensor's saved boxes and their
geometry), `reader` (`DcpCheckpoint`: metadata validation and streaming reads), `importer`
(`import_dcp`), `export` (`export_dcp`), `optimizer_notes` (what an optimizer loading an export
will miss) and `swap` (putting a finished export in place). Their public names are re-exported
here, as are `_exchange` and `_left_behind`, which tests use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ragckpt.convert.dcp.chunks import DcpChunk, DcpTensor
from ragckpt.convert.dcp.export import (
    DEFAULT_EXPORT_FILE_BYTES,
    ExportSummary,
    _left_behind,
    export_dcp,
    local_dcp_path,
    plan_chunks,
)
from ragckpt.convert.dcp.importer import (
    ImportSummary,
    choose_layout,
    choose_model_prefix,
    choose_world_size,
    import_dcp,
)
from ragckpt.convert.dcp.keys import (
    EXTRA_PREFIX,
    MAX_CARRIED_BYTES,
    MODEL_PREFIX,
    OPTIM_PREFIX,
    PARAM_GROUPS_PREFIX,
    PARAM_GROUPS_USER_KEY,
    USER_KEY,
    dcp_key_to_name,
    dcp_user_metadata,
    decode_bytes,
    default_planner_path,
    detect_model_prefix,
    groups_by_param,
    jsonable,
    name_to_dcp_key,
    param_groups_view,
)
from ragckpt.convert.dcp.optimizer_notes import adam_group_keys, optimizer_gaps
from ragckpt.convert.dcp.reader import DcpCheckpoint
from ragckpt.convert.dcp.record import (
    RECORD_FORMAT,
    RECORD_KEY,
    ExportRecord,
    export_record_value,
    read_export_record,
)
from ragckpt.convert.dcp.swap import _exchange

if TYPE_CHECKING:
    import torch
else:  # the same lazy stand-in the modules use (tests patch `torch.save` through it; see ragckpt.lazy)
    from ragckpt.lazy import torch

__all__ = [
    "DEFAULT_EXPORT_FILE_BYTES",
    "EXTRA_PREFIX",
    "MAX_CARRIED_BYTES",
    "MODEL_PREFIX",
    "OPTIM_PREFIX",
    "PARAM_GROUPS_PREFIX",
    "PARAM_GROUPS_USER_KEY",
    "RECORD_FORMAT",
    "RECORD_KEY",
    "USER_KEY",
    "DcpCheckpoint",
    "DcpChunk",
    "DcpTensor",
    "ExportRecord",
    "ExportSummary",
    "ImportSummary",
    "_exchange",
    "_left_behind",
    "adam_group_keys",
    "choose_layout",
    "choose_model_prefix",
    "choose_world_size",
    "dcp_key_to_name",
    "dcp_user_metadata",
    "decode_bytes",
    "default_planner_path",
    "detect_model_prefix",
    "export_dcp",
    "export_record_value",
    "groups_by_param",
    "import_dcp",
    "jsonable",
    "local_dcp_path",
    "name_to_dcp_key",
    "optimizer_gaps",
    "param_groups_view",
    "plan_chunks",
    "read_export_record",
    "torch",
]

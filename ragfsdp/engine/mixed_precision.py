"""The mixed-precision policy, named and shaped as FSDP2's so code moves between the two."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """`param_dtype`: dtype of the gathered (compute) parameters and their gradients; the sharded
    master stays in the parameters' own dtype. `reduce_dtype`: dtype the gradients are reduced in
    (default: `param_dtype`). `cast_forward_inputs`: floating inputs of each unit's forward are cast
    to `param_dtype`, so a bf16 unit gets bf16 activations as under FSDP2."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

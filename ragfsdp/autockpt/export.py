"""A trained model as a Hugging Face safetensors directory, from one of the job's checkpoints."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import ragckpt


def export_hf(url: str, out_dir: str, *, config: Mapping | str | None = None, dtype: str | None = "keep",
              overwrite: bool = False, storage_options: dict | None = None) -> Any:
    """Write the model weights of checkpoint `url` (e.g. `Checkpointer.last_committed`) to `out_dir`
    with ragckpt's streaming exporter (optimizer state is left out) and return its report. `config` (a dict such as
    `model.config.to_dict()`, or a config.json path) makes the directory loadable with
    `from_pretrained`; without it the checkpoint's own `user["hf"]["config"]` is used when present."""
    return ragckpt.export_hf(url, out_dir, config=config, dtype=dtype, overwrite=overwrite,
                             storage_options=storage_options, write_config=True)

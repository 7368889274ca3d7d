"""Converters between ragckpt checkpoints and other formats: Hugging Face safetensors (`hf_import`,
`hf_export`) and PyTorch DCP (`dcp`).

Defaults the CLI shows in its options live here, where importing them loads no torch (see
`ragckpt.lazy`): the DCP converter itself needs torch at import."""

#: export-dcp: the largest DCP chunk (a `torch.save` archive) written
DEFAULT_EXPORT_CHUNK_BYTES = 64 << 20

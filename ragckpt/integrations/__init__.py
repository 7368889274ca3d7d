"""Training frameworks saving to and loading from ragckpt directly, from every rank of a job
(`fsdp2`), as opposed to the converters of `ragckpt.convert`, which rewrite finished checkpoints."""

"""ragfsdp: an FSDP training engine on RaggedShard flat buffers (planned, not yet built).

The engine will keep, per parameter group and dtype, one flat buffer per rank laid out by
`ragckpt.plan_layout` (a `ragckpt.FlatLayout`), so all-gather and reduce-scatter run on the buffer
directly and a checkpoint save is `ragckpt.save_shard(url, rank, buffers, layout)` with no copy and
no collective planning. Elastic restart at another world size reads its new shard with the load-time
resharder. Its own issues come after the checkpoint format; until then this package is intentionally
empty.
"""

"""Storage options of the S3 fault tests: the fixture's options with 5 MiB parts and a 5 MiB
multipart threshold (the least S3 allows), so that a few MiB of data make multipart uploads."""

from __future__ import annotations

MiB = 1 << 20

IO = {"part_size": 5 * MiB, "multipart_threshold": 5 * MiB}


def _opts(opts: dict, **io) -> dict:
    return {**opts, "ragckpt": {**opts["ragckpt"], **IO, **io}}

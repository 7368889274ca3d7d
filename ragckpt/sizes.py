"""Human sizes and granularity policies as users type them on the command line.

One parser for every option: `5GB` is decimal (as Hugging Face reads `--max-shard-size`), `512MiB`
binary, and a bare `K`/`M`/`G`/`T` binary too; a plain integer is bytes.
"""

from __future__ import annotations

import re

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 10**3, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6, "mib": 1 << 20,
          "g": 1 << 30, "gb": 10**9, "gib": 1 << 30, "t": 1 << 40, "tb": 10**12, "tib": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """'512MiB', '1GiB', '64M', '5GB' or a plain byte count -> bytes (positive)."""
    if isinstance(text, int):
        if text <= 0:
            raise ValueError(f"size must be positive, got {text}")
        return text
    m = _SIZE.match(str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"'{text}' is not a size; use e.g. 512MiB, 5GB or a byte count")
    value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value <= 0:
        raise ValueError(f"size '{text}' must be positive")
    return value


def parse_granularity(text: str | None) -> str | int | None:
    """'row', 'element', 'whole', 'rows:K' or an element count (digits) -> a planner granularity."""
    if text is None:
        return None
    text = text.strip()
    if text.isdigit():
        return int(text)
    if text in ("row", "element", "whole") or re.fullmatch(r"rows?:\d+", text):
        return text
    raise ValueError(f"unknown granularity '{text}'; use row, element, whole, rows:K or an element count")

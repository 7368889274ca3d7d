"""The record export-dcp leaves in a DCP `.metadata` (`planner_data`, which torch's loaders
ignore) of the ragckpt checkpoint it came from, and its reading back, so that importing an export
rebuilds the same world size, layout and names without flags. On its own because both the reader
and the exporter use it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ragckpt.checkpoint.manifest import MAX_WORLD_SIZE
from ragckpt.format.names import RESERVED_PREFIXES
from ragckpt.planner.state import PLANNED_KINDS
from ragckpt.reshard.plan import inferred_granularity

#: the `planner_data` key of export-dcp's record of its source (`ExportRecord`): not a state-dict key
#: any save produces; an export whose own tensors use it goes without the record
RECORD_KEY = "__ragckpt_export__"
RECORD_FORMAT = 1
_RECORD_POLICIES = ("whole", "element", "row")  # what `inferred_granularity` yields


@dataclass(frozen=True)
class ExportRecord:
    """What an export came from, kept in its DCP `.metadata` so that import-dcp can rebuild the same
    checkpoint shape without flags: the ragckpt checkpoint's world size, its layout kind, for a
    ragged layout the tensors planned with a granularity other than row (by DCP key), and the model
    prefix the export put before parameter names (so that import maps every key back to the name it
    came from, where guessing could take `extra.ema.weight`'s key `ema.weight` for a parameter).
    Each field is None (empty) when absent or not valid, and then import falls back to its usual
    defaults."""

    world_size: int | None = None
    layout: str | None = None
    granularity: dict[str, str] = field(default_factory=dict)
    model_prefix: str | None = None


def export_record_value(ck: Any, keys: dict[str, str], model_prefix: str) -> dict[str, Any]:
    """The record of checkpoint `ck` exported with `model_prefix` (`keys`: DCP key -> ragckpt name)
    as plain data (ints, strings, dicts: nothing DCP's or ragckpt's metadata unpickler would
    refuse). Granularity is the per-tensor policy reshard infers from a ragged layout (`rows:K`
    blocks are not recorded in the format). The source's URL is left out: an export is often
    shared, and a URL may carry a host or user name."""
    gran: dict[str, str] = {}
    if ck.kind == "ragged":
        key_of = {name: key for key, name in keys.items()}
        for b in ck.layout.buffers:
            for name, policy in inferred_granularity(ck.layout.layouts[b.layout], b.tensors).items():
                if policy != "row" and name in key_of:
                    gran[key_of[name]] = policy
    return {"format": RECORD_FORMAT, "world_size": ck.world_size, "layout": ck.kind, "granularity": gran,
            "model_prefix": model_prefix}


def read_export_record(metadata: Any) -> ExportRecord | None:
    """The record an export left in DCP `metadata.planner_data`, or None (an export by an older
    ragckpt, or any other DCP save). The record lives under a key that names no entry of the state
    dict, where torch never looks: its loaders read `planner_data[k]` only for keys `k` of
    `state_dict_metadata`. Fields that do not validate are dropped, not trusted."""
    pd = getattr(metadata, "planner_data", None)
    value = pd.get(RECORD_KEY) if isinstance(pd, dict) else None
    if not isinstance(value, dict) or value.get("format") != RECORD_FORMAT:  # an entry's path is a tuple
        return None
    w = value.get("world_size")
    world_size = w if isinstance(w, int) and not isinstance(w, bool) and 1 <= w <= MAX_WORLD_SIZE else None
    layout = value.get("layout") if value.get("layout") in PLANNED_KINDS else None
    gran = value.get("granularity")
    granularity = {k: v for k, v in gran.items() if isinstance(k, str) and v in _RECORD_POLICIES} \
        if isinstance(gran, dict) else {}
    p = value.get("model_prefix")
    prefix = p if isinstance(p, str) and not p.startswith(RESERVED_PREFIXES) else None
    return ExportRecord(world_size, layout, granularity, prefix)



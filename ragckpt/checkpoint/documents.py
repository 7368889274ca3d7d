"""What `verify` checks of the documents it does not regenerate byte for byte: the zarr group
documents a plain Zarr reader walks (docs/FORMAT.md section 2) and the ranks' records
(section 4). Pure functions of the bytes and what the checkpoint's verified metadata says: each
returns what is wrong, in words, or None."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ragckpt.checkpoint.manifest import brief, is_count, is_crc, parse_json

_GROUP_FIELDS = {"zarr_format", "node_type", "attributes"}
_RECORD_FIELDS = {"rank", "layout_fingerprint", "save_id", "buffers", "extra"}
_ENTRY_FIELDS = {"nbytes", "crc32c"}

#: what a group document is, for the advice to restore one
GROUP_DOC_TEXT = '{"zarr_format": 3, "node_type": "group", "attributes": {}}'


def _json_object(raw: bytes) -> tuple[dict | None, str | None]:
    """(the JSON object `raw` holds, None), or (None, why it holds none): every document here is one."""
    try:
        doc = parse_json(raw)
    except ValueError:
        return None, "not valid JSON (cut short or overwritten)"
    if not isinstance(doc, dict):
        return None, f"not a JSON object but {brief(doc, 40)}"
    return doc, None


def group_doc_problem(raw: bytes) -> str | None:
    """Why `raw` is no zarr v3 group document (plain zarr raises on it, or takes the node for
    something else and lists none of the arrays below it), or None."""
    doc, problem = _json_object(raw)
    if doc is None:
        return problem
    fmt, node = doc.get("zarr_format"), doc.get("node_type")
    if not is_count(fmt) or fmt != 3:
        return f"zarr_format is {brief(fmt, 40)}, expected 3"
    if node != "group":
        return f"node_type is {brief(node, 40)}, expected 'group'"
    if not isinstance(doc.get("attributes", {}), dict):
        return f"attributes is {brief(doc['attributes'], 40)}, expected an object"
    unknown = sorted(set(doc) - _GROUP_FIELDS)
    if unknown:  # zarr v3: a reader must refuse fields it does not know (zarr-python raises TypeError)
        return f"it has fields zarr does not know: {brief(unknown, 60)}"
    return None


_MARKER_FIELDS = {"format", "format_version", "world_size", "committed_at", "total_bytes", "objects_crc32c"}


def marker_problem(marker: dict) -> str | None:
    """What is wrong with a commit marker beyond what opening checks (its format, world size, total
    and checksums): a field missing or unknown, as a flipped bit in a field's name leaves it."""
    missing, unknown = sorted(_MARKER_FIELDS - set(marker)), sorted(set(marker) - _MARKER_FIELDS)
    if missing or unknown:
        return f"its fields are not a commit marker's (missing {missing or 'none'}, unknown {unknown or 'none'})"
    if not isinstance(marker["committed_at"], str):
        return f"committed_at is {brief(marker['committed_at'], 40)}, expected a time"
    return None


@dataclass(frozen=True)
class RankExpectation:
    """What rank `rank`'s record must say, from the checkpoint's verified metadata."""

    rank: int
    fingerprint: str
    save_id: str | None
    #: per buffer index: the rank's bytes and block checksums (`meta/crc/<b>`'s slice of the rank)
    buffers: Sequence[tuple[int, Sequence[int]]]
    #: (bytes, crc32c) of the rank's extras, None when it saved none (`meta/extra`)
    extra: tuple[int, int] | None


def rank_record_problem(raw: bytes, want: RankExpectation) -> str | None:
    """Why `raw` is not the record (`ranks/<r>.json`) of the rank `want` describes, or None."""
    doc, problem = _json_object(raw)
    if doc is None:
        return problem
    unknown = sorted(set(doc) - _RECORD_FIELDS)
    if unknown:
        return f"it has fields no record has: {brief(unknown, 60)}"
    got = doc.get("rank")
    if not is_count(got) or got != want.rank:
        return f"it says rank {brief(got, 40)}"
    if doc.get("layout_fingerprint") != want.fingerprint:
        return (f"its layout fingerprint {brief(doc.get('layout_fingerprint'), 40)} is not this checkpoint's "
                f"{want.fingerprint!r} (a record of another save)")
    if doc.get("save_id") != want.save_id:  # records name no save exactly where the manifest names none
        return f"it names save {brief(doc.get('save_id'), 40)}, the checkpoint {want.save_id!r}"
    buffers = doc.get("buffers")
    if not isinstance(buffers, dict) or set(buffers) != {str(b) for b in range(len(want.buffers))}:
        return f"its buffers are {brief(buffers, 40)}, expected entries for buffers 0..{len(want.buffers) - 1}"
    for b, (nbytes, crcs) in enumerate(want.buffers):
        entry = buffers[str(b)]
        if not isinstance(entry, dict) or set(entry) != _ENTRY_FIELDS or not is_count(entry["nbytes"]) \
                or entry["nbytes"] != nbytes:
            return f"buffer {b}: {brief(entry, 40)} is not {{nbytes: {nbytes}, crc32c: [...]}}"
        got_crcs = entry.get("crc32c")
        if not isinstance(got_crcs, list) or not all(map(is_crc, got_crcs)) or got_crcs != list(crcs):
            return f"buffer {b}: its block checksums are not those of meta/crc/{b}"
    extra = doc.get("extra", "absent")
    if want.extra is None:
        if extra is not None:
            return f"its extra is {brief(extra, 40)}, but meta/extra records no extras for this rank"
    elif not isinstance(extra, dict) or set(extra) != _ENTRY_FIELDS or (extra["nbytes"], extra["crc32c"]) != want.extra:
        return f"its extra is {brief(extra, 40)}, meta/extra {{nbytes: {want.extra[0]}, crc32c: {want.extra[1]}}}"
    return None

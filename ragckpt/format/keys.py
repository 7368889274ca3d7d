"""The object keys that make a directory a checkpoint: its root metadata, written first, and the
commit marker, written last. Storage code that replaces or discards a checkpoint orders its deletes
by them, so they sit below both the storage layer and the manifest that writes them."""

from __future__ import annotations

COMMIT_KEY = "COMMITTED"
ROOT_META_KEY = "zarr.json"

"""Retry transient storage errors (throttling, 5xx, timeouts, dropped connections) with backoff."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import TypeVar

from ragckpt.errors import DestinationExistsError, StorageError

T = TypeVar("T")

_TRANSIENT_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "InternalError",
                    "ServiceUnavailable", "503", "500", "502", "504", "RequestTimeTooSkewed"}


def is_transient(exc: BaseException) -> bool:
    if isinstance(exc, (FileNotFoundError, FileExistsError, PermissionError, DestinationExistsError)):
        return False
    if isinstance(exc, (TimeoutError, ConnectionError)):
        return True
    name = type(exc).__name__
    if name in ("ReadTimeoutError", "ConnectTimeoutError", "EndpointConnectionError", "ClientPayloadError",
                "ServerDisconnectedError", "ClientOSError", "IncompleteRead", "ResponseStreamingError"):
        return True
    code = ""
    resp = getattr(exc, "response", None)
    if isinstance(resp, dict):
        code = str(resp.get("Error", {}).get("Code", "")) or str(resp.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
    if code in _TRANSIENT_CODES:
        return True
    text = str(exc)
    return any(k in text for k in ("SlowDown", "503", "500 Internal", "Service Unavailable", "reduce your request rate"))


def with_retries(fn: Callable[[], T], what: str, attempts: int = 6, base_delay: float = 0.1) -> T:
    """Call fn; retry transient failures with exponential backoff and jitter, then raise a
    StorageError naming `what`. Permanent errors propagate at once."""
    for i in range(attempts):
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - classified below
            if not is_transient(e):
                raise
            if i == attempts - 1:
                raise StorageError(f"{what}: giving up after {attempts} attempts: {type(e).__name__}: {e}") from e
            time.sleep(base_delay * (2**i) * (0.5 + random.random()))
    raise AssertionError("unreachable")

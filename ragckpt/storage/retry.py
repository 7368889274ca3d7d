"""Retry transient storage errors (throttling, 5xx, timeouts, dropped connections) with backoff.

There are three retry layers on the way to S3: botocore's, s3fs's `_error_wrapper`, and this one.
Stacked, their attempt counts multiply (5 x 5 x 6 = 150 attempts with growing sleeps: many minutes
before a dead endpoint is reported). `ragckpt.storage.remote` therefore turns the first two off and
this module is the single policy: a bounded number of attempts per request (more, and longer sleeps,
when the store throttles), exponential backoff with jitter, and then one StorageError that names the
object's URL. Permanent errors (missing object, access denied, precondition failed) are never
retried; a 409 ConditionalRequestConflict (a conditional write racing another on the same key) is,
as AWS asks.
"""

from __future__ import annotations

import asyncio
import datetime
import email.utils
import random
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from ragckpt.errors import DestinationExistsError, RagckptError, StorageError

T = TypeVar("T")

#: codes of a store asking the whole job to slow down (retried longer than other failures)
THROTTLE_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "ThrottledException", "RequestThrottled",
    "TooManyRequestsException", "RequestLimitExceeded", "ProvisionedThroughputExceededException",
})

#: S3 error codes that mean "try again later", not "your request is wrong"
TRANSIENT_CODES = THROTTLE_CODES | frozenset({
    "RequestTimeout", "RequestTimeoutException", "InternalError", "ServiceUnavailable", "Busy",
    "PriorRequestNotComplete", "BadDigest", "XAmzContentSHA256Mismatch", "IncompleteBody",
    "RequestTimeTooSkewed", "OperationAborted",
    # 409 to a conditional write while another operation on the key is in flight; AWS: retry it
    # (the precondition still guards the retried request)
    "ConditionalRequestConflict",
})

#: exception classes (by name, so optional dependencies need not be imported) that are transport
#: failures: the request may or may not have reached the server, and repeating it is safe for us
#: because every ragckpt write is idempotent or guarded by a precondition
TRANSIENT_NAMES = frozenset({
    # botocore
    "EndpointConnectionError", "ConnectionClosedError", "ReadTimeoutError", "ConnectTimeoutError",
    "ResponseStreamingError", "IncompleteReadError", "ProxyConnectionError", "HTTPClientError",
    "ConnectionError",
    # aiohttp
    "ServerDisconnectedError", "ClientOSError", "ClientConnectionError", "ClientConnectorError",
    "ClientPayloadError", "ServerTimeoutError", "ClientConnectionResetError", "TransferEncodingError",
    "ContentLengthError",
    # http.client / urllib3 / fsspec
    "IncompleteRead", "RemoteDisconnected", "ProtocolError", "FSTimeoutError",
})

_PERMANENT = (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError,
              DestinationExistsError, StorageError)  # StorageError: a verdict already given, e.g. by an inner retry


class TransientIOError(RagckptError):
    """Raised by ragckpt itself for a retryable condition the client libraries do not flag, e.g. a
    response body shorter than its Content-Length."""


def exception_chain(exc: BaseException) -> Iterator[BaseException]:
    """`exc` and the exceptions behind it (causes and contexts), each once."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def error_code(exc: BaseException) -> str:
    """The S3 error code (or HTTP status) behind `exc`, looking through s3fs's translated OSErrors."""
    for e in exception_chain(exc):
        resp = getattr(e, "response", None)
        if isinstance(resp, dict):
            code = str(resp.get("Error", {}).get("Code", "") or "")
            if code:
                return code
            status = resp.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if status:
                return str(status)
    return ""


def http_status(exc: BaseException) -> int | None:
    """The HTTP status of the failed request behind `exc`, if it got a reply."""
    for e in exception_chain(exc):
        resp = getattr(e, "response", None)
        if isinstance(resp, dict):
            status = resp.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if status:
                return int(status)
        status = getattr(e, "status", None)  # aiohttp ClientResponseError
        if isinstance(status, int) and status >= 400:
            return status
    return None


def is_transient(exc: BaseException) -> bool:
    """True for failures worth repeating: throttling, 5xx, timeouts, resets, short bodies."""
    if isinstance(exc, _PERMANENT):
        return False
    for e in exception_chain(exc):
        if isinstance(e, TransientIOError | TimeoutError | ConnectionError):
            return True
        if type(e).__name__ in TRANSIENT_NAMES:
            return True
        if any(c.__name__ in TRANSIENT_NAMES for c in type(e).__mro__[1:]):
            return True
    code = error_code(exc)
    if code in TRANSIENT_CODES:
        return True
    if code == "NotImplemented":  # e.g. a server without conditional writes: retrying cannot help
        return False
    status = http_status(exc)
    if status is not None:
        return (status >= 500 and status != 501) or status == 429
    text = str(exc)
    return any(k in text for k in ("SlowDown", "reduce your request rate", "Service Unavailable"))


def describe(exc: BaseException) -> str:
    """A short one-line description: 'SlowDown: Please reduce your request rate.' for S3 errors,
    'ExceptionType: message' otherwise."""
    for e in exception_chain(exc):
        resp = getattr(e, "response", None)
        if isinstance(resp, dict) and resp.get("Error", {}).get("Code"):
            err = resp["Error"]
            status = resp.get("ResponseMetadata", {}).get("HTTPStatusCode")
            msg = " ".join(str(err.get("Message") or "").split()) or (f"HTTP {status}" if status else "")
            return f"{err['Code']}: {msg}" if msg else str(err["Code"])
    msg = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__


def is_throttle(exc: BaseException) -> bool:
    """True when the store asked us to slow down (SlowDown, 429, 503): the failure is the request
    rate of the whole job, not this request, and clears only as the store scales or load drops."""
    if error_code(exc) in THROTTLE_CODES:
        return True
    return http_status(exc) in (429, 503)


def retry_after(exc: BaseException) -> float | None:
    """Seconds the server asked us to wait (a `Retry-After` header: seconds or an HTTP date)."""
    for e in exception_chain(exc):
        resp = getattr(e, "response", None)
        headers = None
        if isinstance(resp, dict):
            headers = resp.get("ResponseMetadata", {}).get("HTTPHeaders")
        elif getattr(e, "headers", None) is not None:  # aiohttp ClientResponseError
            headers = e.headers  # type: ignore[attr-defined]
        if not headers:
            continue
        value = next((str(v) for k, v in headers.items() if str(k).lower() == "retry-after"), "").strip()
        if not value:
            continue
        try:
            return max(0.0, float(value))
        except ValueError:
            pass
        try:
            when = email.utils.parsedate_to_datetime(value)
            if when.tzinfo is None:  # "-0000": UTC by RFC 5322, but parsed without a zone
                when = when.replace(tzinfo=datetime.UTC)
            return max(0.0, (when - datetime.datetime.now(datetime.UTC)).total_seconds())
        except (TypeError, ValueError, OverflowError):
            return None
    return None


@dataclass(frozen=True)
class RetryPolicy:
    """`attempts` tries in all; sleeps base*2**i (capped at max_delay) times a 0.5-1.5 jitter, so
    many workers throttled together do not retry in lockstep.

    Throttling gets a longer budget (`throttle_attempts`, sleeps capped at `throttle_max_delay`,
    never shorter than a `Retry-After` the server sent, up to that cap): when thousands of ranks
    save at once, S3 answers SlowDown until it has split the prefix's partitions, which takes tens
    of seconds, and failing a checkpoint for it would waste the whole save. Dead endpoints and
    broken connections still fail within a few seconds."""

    attempts: int = 5
    base_delay: float = 0.2
    max_delay: float = 5.0
    throttle_attempts: int = 10
    throttle_max_delay: float = 20.0

    def limit(self, exc: BaseException) -> int:
        """Attempts allowed when the latest one failed with `exc`."""
        return self.throttle_attempts if is_throttle(exc) else self.attempts

    def delay(self, attempt: int, exc: BaseException | None = None) -> float:
        throttled = exc is not None and is_throttle(exc)
        cap = max(self.max_delay, self.throttle_max_delay) if throttled else self.max_delay
        d = min(cap, self.base_delay * (2**attempt)) * (0.5 + random.random())
        asked = retry_after(exc) if exc is not None else None
        if asked is not None:
            d = max(d, min(asked, cap))
        return d


DEFAULT_POLICY = RetryPolicy()


def _give_up(what: str, attempts: int, exc: BaseException, waited: float) -> StorageError:
    hint = "; the store did not answer: try again later, or raise ragckpt.retries"
    if is_throttle(exc):
        hint = (f"; the store kept throttling for {waited:.0f} s: lower ragckpt.concurrency (fewer requests in "
                "flight) or raise ragckpt.throttle_retries")
    return StorageError(f"{what}: giving up after {attempts} attempts: {describe(exc)}{hint}")


class _Attempts:
    """The retry state of one request: which attempt failed last and how long it has slept, shared
    by the blocking and the coroutine loop."""

    def __init__(self, policy: RetryPolicy | None, what: str):
        self.policy = policy or DEFAULT_POLICY
        self.what = what
        self.failed = 0
        self.waited = 0.0

    def backoff(self, e: Exception) -> float:
        """The sleep before the next attempt after transient failure `e`; raises the one-line
        StorageError naming `what` when `e` used up the budget."""
        self.failed += 1
        if self.failed >= self.policy.limit(e):
            raise _give_up(self.what, self.failed, e, self.waited) from e
        d = self.policy.delay(self.failed - 1, e)
        self.waited += d
        return d


def with_retries(fn: Callable[[], T], what: str, *, policy: RetryPolicy | None = None) -> T:
    """Call fn; retry transient failures with backoff, then raise a StorageError naming `what`.
    Permanent errors propagate at once, unchanged, for the caller to word."""
    attempts = _Attempts(policy, what)
    while True:
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - classified below
            if not is_transient(e):
                raise
            time.sleep(attempts.backoff(e))


async def retry_async(fn: Callable[[], Awaitable[T]], what: str, policy: RetryPolicy | None = None) -> T:
    """`with_retries` for coroutines: `fn()` makes a fresh awaitable per attempt."""
    attempts = _Attempts(policy, what)
    while True:
        try:
            return await fn()
        except Exception as e:  # noqa: BLE001 - classified below
            if not is_transient(e):
                raise
            await asyncio.sleep(attempts.backoff(e))

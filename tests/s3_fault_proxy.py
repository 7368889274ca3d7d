"""A fault-injecting HTTP proxy for S3 tests: 127.0.0.1 in front of the moto server.

Tests point s3fs's `endpoint_url` at the proxy instead of moto, so the real s3fs / aiobotocore /
aiohttp stack meets the failures real object stores produce, with nothing in the client patched:

* `error_rate`: answer a fraction of requests with `503 SlowDown` (the request never reaches moto);
* `drop_rate`: for uploads, forward the head and half the body to moto, then reset both connections
  (a connection lost mid-upload); for downloads, relay half the response, then reset;
* `lose_reply`: forward matching requests to moto and let them take effect, then reset the client
  connection instead of relaying the reply (the "did my request land?" case);
* `fail_all`: answer every matching request with 503 (an outage), for clean-failure tests;
* `reply`: answer matching requests with a canned S3 reply (`CannedReply`: a status, an error code
  and message, e.g. `NO_SUCH_UPLOAD`, `CONDITIONAL_CONFLICT`, `ACCESS_DENIED`); with `forward=True`
  the request is forwarded to moto first and takes effect, and only the reply is replaced (a reply
  lost, then the retry answered with what S3 says next);
* `stall`: accept a matching request, then never answer, until `stall_s` has passed or the client
  gives up (a hung connection: a server or middlebox that stopped responding);
* `latency_s`: hold every reply back this long before relaying it (not a fault: not counted). moto
  on the same machine answers in a millisecond; real S3 takes tens of milliseconds to a first byte, so
  a client reading one request at a time is slow there and nowhere else. With it, a test can see
  whether a read path keeps several requests in flight (`Stats.max_inflight`);
* `bandwidth`: with it, a reply of n bytes is held back n / bandwidth seconds more: each request
  alone moves at most `bandwidth` bytes per second, as one S3 connection does (about 100 MB/s), so
  only requests in flight together add up to more;
* `strip_412_condition`: remove the `<Condition>` element from every 412 reply, as MinIO, Ceph RGW
  and other S3 implementations send them (not a fault: not counted, not bounded);
* `serialize_conditional`: forward requests carrying `If-None-Match` one at a time. Real S3 applies
  a conditional PUT atomically; moto checks and stores in separate steps, so two racing committers
  could both pass its check. Serialising only the conditional requests restores S3's semantics
  without helping an implementation that skips the precondition (its plain PUTs are not serialised).

Faults are bounded: at most `max_faults_per_request` injected faults for one request identity
(method + path + query, so each multipart part and each retried PUT counts separately), and at most
`max_faults` in total, so a client with enough retries must succeed and a test can assert it.
Every request is forwarded on a fresh upstream connection with `Connection: close`, which keeps the
proxy small: it reads each response to EOF and relays it.
"""

from __future__ import annotations

import asyncio
import random
import re
import threading
from collections import Counter
from dataclasses import dataclass, field

SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
             b"<Message>Please reduce your request rate.</Message></Error>")

_REASONS = {403: "Forbidden", 404: "Not Found", 409: "Conflict", 412: "Precondition Failed", 503: "Slow Down"}


@dataclass(frozen=True)
class CannedReply:
    """An S3 error reply: `status`, and an XML body with `code` and `message` (none for HEAD, as S3
    sends HEAD errors, or when `code` is empty). `forward`: let moto apply the request first."""

    status: int
    code: str = ""
    message: str = ""
    forward: bool = False
    headers: tuple[tuple[str, str], ...] = ()

    def render(self, method: str) -> bytes:
        body = b""
        if self.code and method != "HEAD":
            body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{self.code}</Code>'
                    f"<Message>{self.message}</Message></Error>").encode()
        extra = "".join(f"{k}: {v}\r\n" for k, v in self.headers)
        head = (f"HTTP/1.1 {self.status} {_REASONS.get(self.status, 'Error')}\r\n{extra}"
                f"Content-Type: application/xml\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n")
        return head.encode("latin-1") + body


#: CompleteMultipartUpload of an upload that was aborted (or already completed)
NO_SUCH_UPLOAD = CannedReply(404, "NoSuchUpload", "The specified upload does not exist. The upload ID may be "
                             "invalid, or the upload may have been aborted or completed.")
#: a conditional write racing another operation on the key (AWS: retry it)
CONDITIONAL_CONFLICT = CannedReply(409, "ConditionalRequestConflict", "A conflicting conditional operation is "
                                   "currently in progress against this resource. Please try again.")
ACCESS_DENIED = CannedReply(403, "AccessDenied", "Access Denied")
INVALID_ACCESS_KEY = CannedReply(403, "InvalidAccessKeyId", "The AWS Access Key Id you provided does not exist "
                                 "in our records.")
#: what S3 answers a HEAD of a missing key when the policy lacks s3:ListBucket: a bare 403
FORBIDDEN = CannedReply(403)


@dataclass
class Faults:
    """What to inject; `methods`/`path_regex` select the requests that may be hit."""

    error_rate: float = 0.0
    drop_rate: float = 0.0
    lose_reply: bool = False
    fail_all: bool = False
    stall: bool = False
    stall_s: float = 30.0
    methods: frozenset[str] = frozenset({"GET", "PUT", "POST", "HEAD", "DELETE"})
    path_regex: str = ""
    drop_min_bytes: int = 1 << 20
    max_faults_per_request: int = 2
    max_faults: int = 1_000
    serialize_conditional: bool = False
    reply: CannedReply | None = None
    strip_412_condition: bool = False
    latency_s: float = 0.0
    bandwidth: float = 0.0
    seed: int = 0


@dataclass
class Stats:
    requests: int = 0
    errors: int = 0
    drops: int = 0
    lost_replies: int = 0
    canned: int = 0
    stalls: int = 0
    by_method: Counter = field(default_factory=Counter)
    #: most requests this proxy had open at once (shows a client's concurrency bound at work)
    max_inflight: int = 0
    inflight: int = 0

    @property
    def faults(self) -> int:
        return self.errors + self.drops + self.lost_replies + self.canned + self.stalls


class FaultProxy:
    """Start with `start()`, stop with `stop()`; `url` is the endpoint to give s3fs."""

    def __init__(self, upstream_port: int, upstream_host: str = "127.0.0.1"):
        self.upstream = (upstream_host, upstream_port)
        self.faults = Faults()
        self.stats = Stats()
        self._lock = threading.Lock()
        self._per_request: Counter = Counter()
        self._rng = random.Random(0)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.base_events.Server | None = None
        self._thread: threading.Thread | None = None
        self._cond_lock: asyncio.Lock | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def configure(self, **kw: object) -> None:
        """Replace the fault settings (keyword arguments of `Faults`) and reset the counters."""
        with self._lock:
            if "methods" in kw:
                kw["methods"] = frozenset(kw["methods"])  # type: ignore[arg-type]
            self.faults = Faults(**kw)  # type: ignore[arg-type]
            self.stats = Stats()
            self._per_request.clear()
            self._rng = random.Random(self.faults.seed)

    def start(self) -> None:
        ready = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            self._cond_lock = asyncio.Lock()
            self._server = loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
            self.port = self._server.sockets[0].getsockname()[1]
            ready.set()
            loop.run_forever()
            self._server.close()
            loop.run_until_complete(self._server.wait_closed())
            loop.close()

        self._thread = threading.Thread(target=run, name="s3-fault-proxy", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("fault proxy did not start")

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(10)

    # -- decisions ---------------------------------------------------------------------------------------
    def _decide(self, method: str, target: str, nbytes: int) -> str:
        with self._lock:
            f, st = self.faults, self.stats
            st.requests += 1
            st.by_method[method] += 1
            if method not in f.methods or (f.path_regex and not re.search(f.path_regex, target)):
                return "ok"
            if f.fail_all:
                st.errors += 1
                return "error"
            if st.faults >= f.max_faults or self._per_request[(method, target)] >= f.max_faults_per_request:
                return "ok"
            if f.stall:
                kind = "stall"
            elif f.reply is not None:
                kind = "canned"
            elif f.lose_reply:
                kind = "lose"
            else:
                r = self._rng.random()
                if r < f.error_rate:
                    kind = "error"
                elif r < f.error_rate + f.drop_rate and (method == "GET" or nbytes >= f.drop_min_bytes):
                    kind = "drop"
                else:
                    return "ok"
            self._per_request[(method, target)] += 1
            if kind == "error":
                st.errors += 1
            elif kind == "drop":
                st.drops += 1
            elif kind == "canned":
                st.canned += 1
            elif kind == "stall":
                st.stalls += 1
            else:
                st.lost_replies += 1
            return kind

    # -- HTTP ----------------------------------------------------------------------------------------------
    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        counted = False
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            with self._lock:
                st = self.stats
                st.inflight += 1
                st.max_inflight = max(st.max_inflight, st.inflight)
                counted = True
            lines = head.decode("latin-1").split("\r\n")
            method, target, _ = lines[0].split(" ", 2)
            headers = [(k.strip(), v.strip()) for k, v in (ln.split(":", 1) for ln in lines[1:] if ln)]
            hmap = {k.lower(): v for k, v in headers}
            if hmap.get("expect", "").lower() == "100-continue":
                writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                await writer.drain()
            declared = int(hmap.get("content-length", "0") or 0)
            kind = self._decide(method, target, declared)
            canned = self.faults.reply if kind == "canned" else None
            if kind == "stall":
                try:  # returns early when the client closes the connection
                    await asyncio.wait_for(reader.read(), self.faults.stall_s)
                except TimeoutError:
                    pass
                writer.transport.abort()
                return
            if kind == "drop" and method != "GET":
                # cut the upload off halfway: the client is still sending when the reset arrives
                partial = await reader.readexactly(declared // 2)
                await self._send_partial(head + partial)
                writer.transport.abort()
                return
            body = await self._read_body(reader, hmap)
            if kind == "error":
                payload = b"" if method == "HEAD" else SLOW_DOWN
                writer.write(b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\n"
                             b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(SLOW_DOWN) + payload)
                await writer.drain()
                return
            fwd = [f"{method} {target} HTTP/1.1"]
            fwd += [f"{k}: {v}" for k, v in headers if k.lower() not in ("connection", "expect", "transfer-encoding")]
            if "transfer-encoding" in hmap:
                fwd.append(f"Content-Length: {len(body)}")
            fwd.append("Connection: close")
            req = ("\r\n".join(fwd) + "\r\n\r\n").encode("latin-1")
            if canned is not None:
                if canned.forward:
                    await self._forward(req + body)
                writer.write(canned.render(method))
                await writer.drain()
                return
            conditional = "if-none-match" in hmap and self.faults.serialize_conditional
            if conditional:
                assert self._cond_lock is not None
                async with self._cond_lock:
                    resp = await self._forward(req + body)
            else:
                resp = await self._forward(req + body)
            if kind == "lose":
                writer.transport.abort()
                return
            f = self.faults
            if f.latency_s or f.bandwidth:
                await asyncio.sleep(f.latency_s + (len(resp) / f.bandwidth if f.bandwidth else 0.0))
            if self.faults.strip_412_condition and resp[9:12] == b"412":
                # same length, so Content-Length still holds: XML allows the blanks
                resp = re.sub(rb"<Condition>[^<]*</Condition>", lambda m: b" " * len(m.group(0)), resp)
            resp = _force_close(resp)
            if kind == "drop":  # a GET cut off halfway through its body
                writer.write(resp[: max(len(resp) // 2, resp.find(b"\r\n\r\n") + 5)])
                await writer.drain()
                writer.transport.abort()
                return
            writer.write(resp)
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
            writer.transport.abort()
        finally:
            if counted:
                with self._lock:
                    st.inflight -= 1
            if not writer.transport.is_closing():
                writer.close()

    @staticmethod
    async def _read_body(reader: asyncio.StreamReader, hmap: dict[str, str]) -> bytes:
        if hmap.get("transfer-encoding", "").lower() == "chunked":
            out = bytearray()
            while True:
                size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
                if size == 0:
                    while (await reader.readuntil(b"\r\n")) != b"\r\n":
                        pass
                    return bytes(out)
                out += await reader.readexactly(size)
                await reader.readexactly(2)
        n = int(hmap.get("content-length", "0") or 0)
        return await reader.readexactly(n) if n else b""

    async def _forward(self, data: bytes) -> bytes:
        r, w = await asyncio.open_connection(*self.upstream)
        try:
            w.write(data)
            await w.drain()
            return await r.read()  # upstream closes after one response (Connection: close)
        finally:
            w.close()

    async def _send_partial(self, data: bytes) -> None:
        r, w = await asyncio.open_connection(*self.upstream)
        w.write(data)
        await w.drain()
        w.transport.abort()


def _force_close(resp: bytes) -> bytes:
    """Make the relayed response say `Connection: close` (we close after it, so the client must not
    reuse the connection)."""
    end = resp.find(b"\r\n\r\n")
    if end < 0:
        return resp
    lines = [ln for ln in resp[:end].split(b"\r\n") if not ln.lower().startswith(b"connection:")]
    return b"\r\n".join([*lines, b"Connection: close"]) + resp[end:]

"""Shared pytest fixtures. S3 tests run real HTTP against moto's S3 server on 127.0.0.1.

Fixtures for object storage (use these in any test that needs S3; nothing here patches a client):

``s3`` (function scope) -> ``S3Target(url, storage_options)``
    A fresh, empty bucket on the session's moto server. Unpacks as a pair::

        def test_x(s3):
            url, opts = s3                       # url = "s3://t-1a2b3c4d5e6f/run" (no trailing /)
            ragckpt.write_global(state, f"{url}/ckpt", 4, storage_options=opts)

    ``opts`` is an ordinary fsspec storage-options dict (endpoint, short timeouts); pass it to every
    ragckpt API as ``storage_options=`` and to CLI commands as ``s3.cli_args()`` (``-o key=value``
    flags). ``s3.fs()`` is a plain s3fs filesystem on the same server for inspecting or planting
    objects behind ragckpt's back. The bucket is emptied and removed afterwards: the server keeps
    every byte in RAM, so keep S3 test data to tens of MiB per test.

``s3_faulty`` (function scope) -> ``FaultyS3(url, storage_options, proxy, direct)``
    Like ``s3`` but the endpoint is a fault-injecting proxy (``tests/s3_fault_proxy.py``) in front of
    moto; ``proxy.configure(error_rate=..., drop_rate=..., ...)`` chooses the failures, ``proxy.stats``
    counts them, and ``direct`` is an ``S3Target`` for the same bucket that bypasses the proxy (to
    check what really got stored). Its storage options also set ragckpt's retry policy to short
    backoffs so that fault tests stay fast.

``fast_dir`` (function scope) -> a scratch directory path
    On tmpfs when there is one (fsync is free there, so thousands of rank objects cost
    milliseconds); the storage code paths are identical. Removed afterwards.

``moto_endpoint`` (session scope) -> "http://127.0.0.1:PORT"
    The moto server itself (started once, on a free port, stopped at the end of the session). Also
    sets dummy AWS credentials and ``AWS_DEFAULT_REGION`` for the session and hides any real AWS
    configuration so that tests can never reach a real account.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import tempfile
import uuid
from collections.abc import Iterator
from typing import Any, NamedTuple

import pytest

from tests.s3_fault_proxy import FaultProxy

_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_CONFIG_FILE": "/nonexistent/ragckpt-tests/aws-config",
    "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/ragckpt-tests/aws-credentials",
    "AWS_EC2_METADATA_DISABLED": "true",
}
_AWS_UNSET = ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN",
              "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_ROLE_ARN",
              "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
              "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI")

# A shell starts background jobs (`make test &`, nohup, some CI runners) with SIGINT ignored, and an
# ignored signal stays ignored across exec: every CLI process a test starts and interrupts would then
# ignore its Ctrl-C. The Ctrl-C tests are about ragckpt's handling, so the suite starts from the
# interpreter's usual dispositions whatever launched it.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
if signal.getsignal(signal.SIGTERM) is signal.SIG_IGN:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


@pytest.fixture(autouse=True)
def _signal_handlers_restored() -> Iterator[None]:
    """A test that runs a CLI entry point in-process (which installs its own SIGTERM handler, and
    ignores signals once its command is done) must not change how later tests' processes react."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for s, handler in saved.items():
        if signal.getsignal(s) is not handler:
            signal.signal(s, handler)


#: timeouts short enough that a hung request fails a test in seconds, long enough for 2 busy cores
_TEST_CONFIG = {"connect_timeout": 5, "read_timeout": 30}


def s3_options(endpoint: str, **ragckpt_io: Any) -> dict:
    """fsspec storage options for the test server at `endpoint` (plus ragckpt I/O settings)."""
    opts: dict[str, Any] = {"client_kwargs": {"endpoint_url": endpoint}, "config_kwargs": dict(_TEST_CONFIG)}
    if ragckpt_io:
        opts["ragckpt"] = ragckpt_io
    return opts


def cli_storage_args(opts: dict) -> list[str]:
    """Storage options as CLI flags: {'a': {'b': 1}} -> ['-o', 'a.b=1']."""
    out: list[str] = []

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        else:
            out.extend(["-o", f"{prefix}={node}"])

    walk("", opts)
    return out


_RAW_FS: dict[str, Any] = {}


class S3Target(NamedTuple):
    url: str
    storage_options: dict

    @property
    def bucket(self) -> str:
        return self.url.split("://", 1)[1].split("/", 1)[0]

    def cli_args(self) -> list[str]:
        """`-o key=value` flags carrying these storage options, for CLI tests."""
        return cli_storage_args(self.storage_options)

    def fs(self) -> Any:
        """A plain s3fs filesystem (no ragckpt code) on the same endpoint; one per endpoint, since a
        new client costs a few hundred ms (botocore loads the S3 service model)."""
        import s3fs

        endpoint = self.storage_options["client_kwargs"]["endpoint_url"]
        if endpoint not in _RAW_FS:
            _RAW_FS[endpoint] = s3fs.S3FileSystem(
                skip_instance_cache=True, client_kwargs={"endpoint_url": endpoint},
                config_kwargs=dict(self.storage_options.get("config_kwargs", {})))
        return _RAW_FS[endpoint]


class FaultyS3(NamedTuple):
    url: str
    storage_options: dict
    proxy: FaultProxy
    direct: S3Target


@pytest.fixture
def fast_dir() -> Iterator[str]:
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    d = tempfile.mkdtemp(prefix="ragckpt-test-", dir=base)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    from moto.server import ThreadedMotoServer

    saved = {k: os.environ.get(k) for k in (*_AWS_ENV, *_AWS_UNSET)}
    os.environ.update(_AWS_ENV)
    for k in _AWS_UNSET:
        os.environ.pop(k, None)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _fresh_bucket(endpoint: str) -> Iterator[S3Target]:
    bucket = f"t-{uuid.uuid4().hex[:12]}"
    target = S3Target(f"s3://{bucket}/run", s3_options(endpoint))
    fs = target.fs()
    fs.mkdir(bucket)
    try:
        yield target
    finally:
        try:
            fs.rm(bucket, recursive=True)  # frees the server's RAM
        except FileNotFoundError:
            pass


@pytest.fixture
def s3(moto_endpoint: str) -> Iterator[S3Target]:
    yield from _fresh_bucket(moto_endpoint)


@pytest.fixture(scope="session")
def _fault_proxy(moto_endpoint: str) -> Iterator[FaultProxy]:
    port = int(moto_endpoint.rsplit(":", 1)[1])
    proxy = FaultProxy(port)
    proxy.start()
    try:
        yield proxy
    finally:
        proxy.stop()


@pytest.fixture
def s3_faulty(moto_endpoint: str, _fault_proxy: FaultProxy) -> Iterator[FaultyS3]:
    _fault_proxy.configure()  # no faults until the test asks
    for direct in _fresh_bucket(moto_endpoint):
        opts = s3_options(_fault_proxy.url, retries=6, retry_delay=0.01, retry_max_delay=0.2, throttle_max_delay=0.2)
        yield FaultyS3(direct.url, opts, _fault_proxy, direct)
        _fault_proxy.configure()


@pytest.fixture(scope="module")
def group() -> Iterator[None]:
    """A 1-rank gloo group in this process (torn down afterwards for the rest of the suite), for the
    FSDP2 adapter's tests that need no second process."""
    import torch.distributed as dist

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if created:
        dist.destroy_process_group()

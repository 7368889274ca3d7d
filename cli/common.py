"""Shared CLI plumbing: storage options, one-line errors, JSON output, progress bars."""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import sys
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import click

from ragckpt.checkpoint.manifest import MAX_WORLD_SIZE  # noqa: F401 - the CLI's --to/--from/--world-size bound
from ragckpt.checkpoint.writer import DEFAULT_MEMORY_BYTES
from ragckpt.errors import RagckptError
from ragckpt.planner.state import PLANNED_KINDS
from ragckpt.sizes import parse_granularity, parse_size


def _is_decimal(text: str) -> bool:
    head, dot, tail = text.partition(".")
    return bool(dot) and (head.isdigit() or not head) and tail.isdigit()


def parse_storage_options(pairs: tuple[str, ...]) -> dict:
    """`--storage-option key=value` pairs -> fsspec storage options. Nested keys use dots
    (`client_kwargs.endpoint_url=http://...`); true/false/ints are converted."""
    out: dict[str, Any] = {}
    for p in pairs:
        if "=" not in p:
            raise click.BadParameter(f"'{p}' is not key=value", param_hint="--storage-option")
        key, val = p.split("=", 1)
        if not key or any(not k for k in key.split(".")):
            raise click.BadParameter(f"'{p}' has an empty key", param_hint="--storage-option")
        v: Any = val
        if val.lower() in ("true", "false"):
            v = val.lower() == "true"
        elif val.isdigit():
            v = int(val)
        elif _is_decimal(val):  # timeouts: botocore compares them with numbers
            v = float(val)
        node = out
        parts = key.split(".")
        for i, k in enumerate(parts[:-1]):
            node = node.setdefault(k, {})
            if not isinstance(node, dict):  # -o a=1 then -o a.b=2
                raise click.BadParameter(f"'{p}' conflicts with the earlier value of '{'.'.join(parts[:i + 1])}'; "
                                         "give either the whole value or its dotted keys", param_hint="--storage-option")
        if isinstance(node.get(parts[-1]), dict):  # -o a.b=2 then -o a=1
            raise click.BadParameter(f"'{p}' conflicts with the earlier '{key}.*' keys; give either the whole "
                                     "value or its dotted keys", param_hint="--storage-option")
        node[parts[-1]] = v
    return out


_storage_option_param = click.option(
    "--storage-option", "-o", "storage_options", multiple=True, metavar="KEY=VALUE",
    callback=lambda ctx, param, value: parse_storage_options(value),
    help="fsspec storage option for s3:// and other URLs (repeatable), e.g. "
         "-o client_kwargs.endpoint_url=http://127.0.0.1:9000; ragckpt.* keys also apply to local paths",
)


def storage_option(f: Callable) -> Callable:
    """The `-o` option, plus a note on stderr when every path the command was given is local: an
    endpoint or credentials meant for s3:// would otherwise be dropped without a word, and a user
    who forgot the scheme would never learn why nothing reached the bucket."""

    @functools.wraps(f)
    def checked(*args: Any, **kwargs: Any) -> Any:
        ctx = click.get_current_context()
        fsspec_keys = sorted(k for k in (kwargs.get("storage_options") or {}) if k != "ragckpt")
        urls = [ctx.params.get(p.name) for p in ctx.command.params if isinstance(p, click.Argument)]
        urls = [u for u in urls if isinstance(u, str) and u]
        if fsspec_keys and urls and not any(_is_remote(u) for u in urls):
            click.echo(f"note: -o {', '.join(fsspec_keys)} applies to s3:// and other remote URLs only; every path "
                       "here is local, so it has no effect", err=True)
        return f(*args, **kwargs)

    return _storage_option_param(checked)


def _is_remote(url: str) -> bool:
    return "://" in url and not url.lower().startswith("file://")


def nonempty_url(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """Click callback for a source path or URL argument: an empty one (a script's unset variable)
    would otherwise be taken as the current directory. A usage error, like other bad arguments."""
    if value == "":
        name = param.human_readable_name
        raise click.UsageError(f"{name} is empty (an unset variable?); give a path or URL", ctx=ctx)
    return value


json_option = click.option("--json", "as_json", is_flag=True, help="Print a machine-readable JSON summary.")


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def one_line(text: str) -> str:
    """`text` with control characters written as escapes (`\\n`, `\\x1b`): a path holding a newline
    would split an error over two lines (and a script reading one line per error would misread it)."""
    return _CONTROL.sub(lambda m: _NAMED.get(m.group(), f"\\x{ord(m.group()):02x}"), text)


def fail(message: str, code: int = 2) -> None:
    """One line on stderr and exit `code`. A command run with --json also prints `{"error": ...}` on
    stdout (the message as it is: JSON escapes it), so a script that parses the output always gets JSON."""
    click.echo(f"error: {one_line(message)}", err=True)
    ctx = click.get_current_context(silent=True)
    # under torchrun every process fails alike; process 0 alone prints the document, as on success
    other_process = ctx is not None and ctx.params.get("distributed") and os.environ.get("RANK", "0") != "0"
    if ctx is not None and ctx.params.get("as_json") and not other_process:
        emit_json({"error": message})
    sys.exit(code)


def _noted(message: str, e: BaseException) -> str:
    """`message` plus what happened to the destination, where the failed job said (an
    --overwrite'n destination put back, or gone: see `storage.destination.replacing`)."""
    note = getattr(e, "ragckpt_note", None)
    return f"{message}; {note}" if note else message


class Terminated(BaseException):
    """SIGTERM (`timeout`, Slurm, `docker stop`), raised in the main thread like Ctrl-C's
    KeyboardInterrupt so that cleanups run: an --overwrite'n destination is put back."""


def interruption(e: BaseException) -> tuple[str, int]:
    """What stopped the command (`Terminated` or KeyboardInterrupt), in a word, and its exit code."""
    return ("terminated", 143) if isinstance(e, Terminated) else ("interrupted", 130)


def raise_on_sigterm() -> None:
    """Turn SIGTERM into `Terminated` for the rest of this process (the CLI's own process only)."""

    def handler(signum: int, frame: Any) -> None:
        raise Terminated

    signal.signal(signal.SIGTERM, handler)


def handle_errors(fn: Callable) -> Callable:
    """Turn every expected failure into one line on stderr and a non-zero exit; never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except RagckptError as e:
            fail(str(e))
        except KeyError as e:
            fail(_noted(str(e.args[0]) if e.args else "key not found", e))
        except BrokenPipeError:
            # the reader went away (`ragckpt ls | head`): stop quietly, as a SIGPIPE would
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(141)
        except (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError) as e:
            fail(_noted(f"{e.filename}: {e.strerror}" if e.filename else str(e.strerror or e), e))
        except (OSError, ValueError) as e:
            fail(_noted(f"{type(e).__name__}: {e}", e))
        except MemoryError as e:  # before OSError's and the last resort's: its message is empty
            fail(_noted("out of memory: the command needed more memory than this process may use (a memory "
                        "limit, ulimit -v, or a cgroup); raise the limit, or lower --memory/--window where the "
                        "command has one", e))
        except (KeyboardInterrupt, Terminated) as e:
            what, code = interruption(e)
            note = getattr(e, "ragckpt_note", None)  # e.g. an --overwrite'n destination put back
            fail(f"{what} before the command finished; " + (note or "any output it was writing is incomplete and "
                                                             "not committed (re-run the command)"), code)
        except (click.ClickException, click.exceptions.Exit, click.Abort):  # click's own control flow
            raise
        except Exception as e:  # noqa: BLE001 - the last resort: a bug of ours, still one line
            if os.environ.get("RAGCKPT_DEBUG"):  # the traceback, and still the exit status of a bug
                traceback.print_exc()
            fail(_noted(f"internal error ({type(e).__name__}: {e}); please report it, with the traceback that "
                        "RAGCKPT_DEBUG=1 prints", e), 3)

    return wrapper


#: JSON goes out in pieces no larger than a pipe's buffer
_JSON_PIECE = 64 << 10


def emit_json(obj: Any) -> None:
    """One JSON document on stdout, flushed in pieces of at most a pipe's buffer: one large write into
    a pipe whose reader goes away (`| head -c 10`) ends short rather than failing, and the command
    exited 0 with its document cut off; a piece written after the reader left raises BrokenPipeError,
    which ends the command as SIGPIPE would (141)."""
    text = json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n"
    out = sys.stdout
    for i in range(0, len(text), _JSON_PIECE):
        out.write(text[i : i + _JSON_PIECE])
        out.flush()


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def human_rate(nbytes: float, seconds: float) -> str:
    """Throughput in decimal units (GB/s, as the benchmarks print), scaled so a small job does not
    read "0.00 GB/s"."""
    rate = nbytes / seconds if seconds > 0 else 0.0
    for unit, scale in (("GB/s", 1e9), ("MB/s", 1e6)):
        if rate >= scale:
            return f"{rate / scale:.2f} {unit}"
    return f"{rate / 1e3:.1f} kB/s"


class ProgressBar:
    """Call with a byte count to advance; `set_total` for jobs that learn their size after planning."""

    def __init__(self, prog: Any = None, task: Any = None):
        self._prog, self._task = prog, task

    def __call__(self, n: int) -> None:
        if self._prog is not None:
            self._prog.advance(self._task, n)

    def set_total(self, n: int) -> None:
        if self._prog is not None:
            self._prog.update(self._task, total=n)


@contextmanager
def progress_bar(total_bytes: int | None, description: str, enabled: bool = True) -> Iterator[ProgressBar]:
    """A rich bar with bytes and throughput on a TTY; a no-op otherwise (or when disabled)."""
    if not (enabled and sys.stderr.isatty()):
        yield ProgressBar()
        return
    # rich takes about 0.15 s to import: only a command that shows a bar pays for it
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  TimeRemainingColumn(), transient=True, console=Console(stderr=True)) as prog:
        # on stderr, where the TTY was found: rich's default console is stdout, so a redirected or
        # piped result (`ragckpt verify CK > f`) started with the bar's empty line
        yield ProgressBar(prog, prog.add_task(description, total=total_bytes))


def size_callback(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    """Click callback: a size option (512MiB, 5GB, bytes) as bytes; a bad value is a usage error."""
    if value is None:
        return None
    try:
        return parse_size(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


memory_option = click.option(
    "--memory", default=f"{DEFAULT_MEMORY_BYTES >> 20}MiB", show_default=True, callback=size_callback,
    help="Working-memory budget for data in flight (e.g. 256MiB, 2GiB); bounds peak RSS whatever the model size.",
)


def granularity_callback(ctx: click.Context, param: click.Parameter, value: str | None) -> str | int | None:
    """Click callback: row, element, whole, rows:K or an element count."""
    try:
        return parse_granularity(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


def new_layout_options(f: Any = None, *, recorded: bool = False) -> Any:
    """`--layout` and `--granularity` for commands that create a checkpoint from another format
    (import-hf, import-dcp): the layout kind the new checkpoint gets, and the planner's block.
    A --granularity given with another layout is a usage error rather than silently ignored.
    With `recorded` (import-dcp) options left out stay None, so that what the source recorded of
    its own layout (an export-dcp of a ragckpt checkpoint) decides before ragged/row do."""
    if f is None:
        return functools.partial(new_layout_options, recorded=recorded)

    @functools.wraps(f)
    def checked(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("granularity") is not None:
            if recorded and kwargs.get("layout") is None:
                kwargs["layout"] = "ragged"  # a planner block says which layout is meant
            if kwargs.get("layout") != "ragged":
                raise click.UsageError(f"--granularity applies to --layout ragged only (got --layout {kwargs['layout']})")
        if not recorded:
            kwargs["granularity"] = kwargs.get("granularity") or "row"
        return f(*args, **kwargs)

    granularity_default = "the block an export-dcp recorded, else row" if recorded else "row"
    with_granularity = click.option(
        "--granularity", default=None, callback=granularity_callback,
        help="Atomic block for the ragged planner: row, element, rows:K, whole, or an element count "
             f"(default: {granularity_default}).",
    )(checked)
    default_note = " (default: the layout an export-dcp recorded, else ragged)" if recorded else ""
    return click.option("--layout", type=click.Choice(PLANNED_KINDS),
                        default=None if recorded else "ragged", show_default=not recorded,
                        help="ragged = structure-aware planner; row = FSDP2 Shard(0); element = FSDP1/ZeRO flat "
                             f"partition{default_note}.")(with_granularity)

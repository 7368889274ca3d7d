"""Entry point of the `ragckpt` command.

Each module in `cli/commands/` exports a `commands` list of click commands; they are registered here
so feature areas (inspection, resharding, conversion, storage) live in separate files.
"""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
import signal
import sys

import click

from cli import commands as _commands_pkg
from cli.common import Terminated, interruption, one_line, raise_on_sigterm


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="ragckpt")
def cli() -> None:
    """Checkpoints and resharding for RaggedShard-sharded training.

    \b
    Examples:
      ragckpt info /ckpt/step_1000
      ragckpt verify s3://bucket/run7/step_1000
      ragckpt reshard /ckpt/step_1000 /ckpt/step_1000_w4096 --to 4096
    """


for _mod in sorted(m.name for m in pkgutil.iter_modules(_commands_pkg.__path__)):
    for _cmd in importlib.import_module(f"cli.commands.{_mod}").commands:
        cli.add_command(_cmd)


def main(args: list[str] | None = None) -> None:
    """Run the CLI on `args` (default: the command line). Usage errors are one line too, like every
    other error (click would print the usage block, a hint and a blank line first)."""
    args = sys.argv[1:] if args is None else list(args)
    raise_on_sigterm()
    try:
        code = cli.main(args=args, prog_name="ragckpt", standalone_mode=False)
        # done and reported: a Ctrl-C from here on (interpreter shutdown, thread joins) must not turn
        # a committed result into exit status 130
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    except (KeyboardInterrupt, Terminated) as e:  # between commands' own handling and here (click's setup, teardown)
        what, code = interruption(e)
        click.echo(f"error: {what}", err=True)
        sys.exit(code)
    except BrokenPipeError:  # the reader of the overview or of an error went away: as a SIGPIPE would
        _quiet_exit_141()
    except SystemExit as e:
        # click ends a write to a closed pipe (`ragckpt reshard --help | head -1`) with exit status 1,
        # after wrapping stdout to keep the interpreter's last flush quiet; the README promises 141
        if e.code == 1 and type(sys.stdout).__name__.endswith("PacifyFlushWrapper"):
            _quiet_exit_141()
        raise
    except click.exceptions.NoArgsIsHelpError as e:  # plain `ragckpt`: the overview, not an error
        try:
            click.echo(e.ctx.get_help() if e.ctx is not None else cli.get_help(click.Context(cli)))
            sys.stdout.flush()
        except BrokenPipeError:
            _quiet_exit_141()
        sys.exit(0)
    except click.UsageError as e:
        where = f"ragckpt {e.ctx.command.name}" if e.ctx is not None and e.ctx.command.name != "cli" else "ragckpt"
        message = f"{e.format_message()} (see '{where} --help')"
        click.echo(f"error: {one_line(message)}", err=True)
        if "--json" in args:  # a script that asked for JSON gets JSON, as for every other error
            try:
                click.echo(json.dumps({"error": message}, indent=2))
                sys.stdout.flush()
            except BrokenPipeError:
                _quiet_exit_141()
        sys.exit(e.exit_code)
    except click.Abort:
        click.echo("error: aborted", err=True)
        sys.exit(1)
    except click.ClickException as e:
        click.echo(f"error: {one_line(e.format_message())}", err=True)
        sys.exit(e.exit_code)
    sys.exit(code if isinstance(code, int) else 0)


def _quiet_exit_141() -> None:
    """Exit as a process killed by SIGPIPE does, without the interpreter's complaint about flushing a
    closed stdout."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    sys.exit(141)


if __name__ == "__main__":
    main()

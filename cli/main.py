"""Entry point of the `ragckpt` command.

Each module in `cli/commands/` exports a `commands` list of click commands; they are registered here
so feature areas (inspection, resharding, conversion, storage) live in separate files.
"""

from __future__ import annotations

import importlib
import pkgutil

import click

from cli import commands as _commands_pkg


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


def main() -> None:
    cli(prog_name="ragckpt")


if __name__ == "__main__":
    main()

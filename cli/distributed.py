"""The module torchrun starts for a distributed reshard:

    torchrun --nproc-per-node K -m cli.distributed SRC DST --to N [options]

is exactly `ragckpt reshard --distributed SRC DST --to N [options]` (the same options and `--help`,
one-line errors, `--json` from process 0 alone, the summary, and SIGTERM from torchrun turned into
an exit through the cleanups, so process 0 puts an --overwrite'n DST back). torchrun runs a module
or a script, so the command has this module as well as `$(which ragckpt) reshard --distributed`.
"""

from __future__ import annotations

import sys

from cli.main import main as cli_main


def main(argv: list[str] | None = None) -> None:
    """Runs the command on `argv` (default: this process's arguments) and exits; never returns."""
    cli_main(["reshard", "--distributed", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    main()

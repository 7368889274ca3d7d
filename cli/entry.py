"""The `ragckpt` console script. Importing the commands pulls in torch, which takes a second or two;
a Ctrl-C in that time would otherwise print an import traceback instead of one line."""

from __future__ import annotations

import json
import sys


def main() -> None:
    try:
        from cli.main import main as run  # the commands, and torch with some: a Ctrl-C here is one line
    except KeyboardInterrupt:
        sys.stderr.write("error: interrupted\n")
        if "--json" in sys.argv[1:]:  # a script that asked for JSON gets JSON, as for every other error
            sys.stdout.write(json.dumps({"error": "interrupted"}, indent=2) + "\n")
        sys.exit(130)
    run()

"""The `flashcode` console script. It imports the command line (MLX, transformers: a second or more) inside a
Ctrl-C guard: a Ctrl-C in that second printed the traceback of the import instead of one line."""

from __future__ import annotations

import sys


def main() -> int:
    try:
        from .cli import main as run

        return run()
    except KeyboardInterrupt:  # the command's own handler covers its work; this, the import and the parse
        print("\nflashcode: stopped (Ctrl-C)", file=sys.stderr)
        return 130

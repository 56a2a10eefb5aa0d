"""The ``kvcore`` console script (``python -m kvcore``): the command line of :mod:`kvcore.commands.app`.

The command line's own dependencies (typer, rich) come with ``pip install 'kvcore[cli]'``:
the library an engine imports needs neither, so a server does not carry them.  Without
them the script says so in one line on stderr and exits 2.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["main"]

#: What ``kvcore[cli]`` adds (and click, which typer brings).
CLI_DEPENDENCIES = ("typer", "rich", "click")


def main(argv: list[str] | None = None) -> None:
    """Run the ``kvcore`` command line (exit codes: :mod:`kvcore.commands.errors`)."""
    try:
        from kvcore.commands.app import run
    except ModuleNotFoundError as exc:
        if exc.name not in CLI_DEPENDENCIES:
            raise
        print(f"kvcore: error: the command line needs {exc.name!r}, which kvcore[cli] installs: "
              "pip install 'kvcore[cli]'", file=sys.stderr)
        sys.exit(2)
    run(argv)


def __getattr__(name: str) -> Any:
    # ``kvcore.cli.app``: the typer app, for callers that drive it (typer's CliRunner), built on first use.
    if name == "app":
        from kvcore.commands.app import app

        return app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

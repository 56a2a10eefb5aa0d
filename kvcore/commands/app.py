"""The ``kvcore`` command's typer app: data on stdout, diagnostics on stderr, ``--json`` for machines.

A thin assembly: each subcommand lives in its own module and is registered here with one
line; :mod:`kvcore.commands.errors` decides how an error ends the command (exit codes).
The console script is :func:`kvcore.cli.main`, which imports this module only when it runs.
"""

from __future__ import annotations

import sys

import typer

from kvcore.bench.cli import bench

try:  # the parser's usage errors: typer >= 0.2x vendors click and raises its own
    from typer import TyperException as ParseError
except ImportError:  # pragma: no cover - older typer raises click's
    from click import ClickException as ParseError  # type: ignore[import-not-found,no-redef,assignment,unused-ignore]
from kvcore.commands.backends import backends
from kvcore.commands.fuzz import fuzz

app = typer.Typer(
    name="kvcore",
    help="KV-cache bookkeeping for LLM serving: list backends, benchmark them.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

app.command("backends")(backends)
app.command("bench")(bench)
app.command("fuzz")(fuzz)
app.command("mrc")(__import__("kvcore.mrc.cli", fromlist=["mrc"]).mrc)


def run(argv: list[str] | None = None) -> None:
    """Run the CLI: a user's error is one line on stderr, a bug its traceback (exit codes: kvcore.commands.errors)."""
    from kvcore.commands.errors import EXIT_USAGE, report_exception

    try:
        # Outside standalone mode a command's typer.Exit comes back as the return value.
        status = app(args=argv, prog_name="kvcore", standalone_mode=False)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        typer.echo("kvcore: aborted", err=True)
        sys.exit(130)
    except ParseError as exc:
        # Click's usage errors (a value typer could not parse, an unknown option): its message, exit status 2.
        typer.echo(f"kvcore: error: {exc.format_message()}", err=True)
        sys.exit(EXIT_USAGE if exc.exit_code == 2 else exc.exit_code)
    except Exception as exc:
        sys.exit(report_exception(exc))
    if isinstance(status, int) and status:
        sys.exit(status)


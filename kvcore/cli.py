"""The ``kvcore`` command: data on stdout, diagnostics on stderr, ``--json`` for machines."""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer

app = typer.Typer(
    name="kvcore",
    help="KV-cache bookkeeping for LLM serving: list backends, benchmark them.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.command()
def backends(
    as_json: Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")] = False,
) -> None:
    """List every backend found (distribution, version, description) and every plugin that failed to load."""
    from kvcore.plugins import available_backends, available_eviction_policies, plugin_failures

    specs = available_backends()
    failures = plugin_failures()
    if as_json:
        payload = {
            "backends": [s.to_json() for s in specs.values()],
            "failed": [f.to_json() for f in failures],
            "eviction_policies": available_eviction_policies(),
        }
        typer.echo(json.dumps(payload, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title="kvcore backends")
    for col in ("backend", "distribution", "version", "description"):
        table.add_column(col)
    for s in specs.values():
        table.add_row(s.name, s.distribution, s.version, s.description)
    Console(soft_wrap=True).print(table)
    for f in failures:
        typer.echo(f"failed: {f.plugin} ({f.distribution}): {f.error}")


def _register_bench() -> None:
    from kvcore.bench.cli import bench

    app.command("bench")(bench)


_register_bench()


def main(argv: list[str] | None = None) -> None:
    """Run the CLI; kvcore's own errors become one line on stderr and exit status 1."""
    from kvcore.errors import KvcoreError

    try:
        app(args=argv, prog_name="kvcore", standalone_mode=False)
    except (KvcoreError, ValueError, LookupError, OSError) as exc:
        typer.echo(f"kvcore: error: {exc}", err=True)
        sys.exit(1)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        typer.echo("kvcore: aborted", err=True)
        sys.exit(130)
    except Exception as exc:
        # Usage errors are click's ClickException (vendored by newer typer): match its shape.
        if hasattr(exc, "format_message") and hasattr(exc, "exit_code"):
            typer.echo(f"kvcore: error: {exc.format_message()}", err=True)
            sys.exit(exc.exit_code)
        raise

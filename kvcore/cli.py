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
    """List every backend and device found (distribution, version, description; for devices whether they are
    usable here and why not) and every plugin that failed to load."""
    from kvcore.plugins import (
        available_backends,
        available_device_specs,
        available_eviction_policies,
        plugin_failures,
    )

    specs = available_backends()
    devices = available_device_specs()
    failures = plugin_failures()
    if as_json:
        payload = {
            "backends": [s.to_json() for s in specs.values()],
            "devices": [d.to_json() for d in devices.values()],
            "failed": [f.to_json() for f in failures],
            "eviction_policies": available_eviction_policies(),
        }
        typer.echo(json.dumps(payload, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    console = Console(soft_wrap=True)
    table = Table(title="kvcore backends")
    for col in ("backend", "distribution", "version", "description"):
        table.add_column(col)
    for s in specs.values():
        table.add_row(s.name, s.distribution, s.version, s.description)
    console.print(table)
    # One plain line per device, so the reason is never wrapped or cut by a narrow table.
    typer.echo("devices (--device):")
    for d in devices.values():
        why = d.availability()
        here = "available" if why is None else f"not available: {why}"
        about = f" -- {d.description}" if d.description else ""
        typer.echo(f"  {d.name} ({d.distribution} {d.version}): {here}{about}")
    for f in failures:
        typer.echo(f"failed: {f.plugin} ({f.distribution}): {f.error}")


@app.command()
def fuzz(
    backend: Annotated[str, typer.Option("--backend", help="Backend to fuzz (see `kvcore backends`).")],
    ops: Annotated[int, typer.Option("--ops", min=0, help="Random operations to run.")] = 100_000,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the operation sequence.")] = 0,
    check_every: Annotated[
        int, typer.Option("--check-every", min=1, help="Run the invariant checker every K operations.")
    ] = 100,
    bad_rate: Annotated[
        float, typer.Option("--bad-rate", min=0.0, max=1.0, help="Share of operations that are bad inputs.")
    ] = 0.05,
    page_size: Annotated[
        int | None, typer.Option("--page-size", min=1, help="Page size (default: the backend's).")
    ] = None,
) -> None:
    """Seeded random engine operations, bad inputs mixed in, the invariant checker every K operations."""
    from kvcore.fuzz import FuzzFailure, run_fuzz

    def progress(done: int) -> None:
        typer.echo(f"kvcore fuzz: {done:,} / {ops:,} operations", err=True)

    try:
        result = run_fuzz(
            backend, ops, seed, check_every=check_every, bad_rate=bad_rate, page_size=page_size, progress=progress
        )
    except FuzzFailure as exc:
        typer.echo(
            f"kvcore fuzz: FAILED: backend {exc.backend}, seed {exc.seed}, operation {exc.op}: {exc.what}", err=True
        )
        typer.echo(f"kvcore fuzz: replay: {exc.replay}", err=True)
        sys.exit(1)
    bad = sum(v for k, v in result.counts.items() if k.startswith("bad: "))
    typer.echo(
        f"kvcore fuzz: backend {backend}, seed {seed}: {result.ops:,} operations ({bad:,} bad inputs refused), "
        f"{result.checks:,} invariant checks, clean, {result.seconds:.1f} s"
    )


def _register_bench() -> None:
    from kvcore.bench.cli import bench

    app.command("bench")(bench)


_register_bench()
app.command("mrc")(__import__("kvcore.mrc.cli", fromlist=["mrc"]).mrc)  # miss-ratio curves (kvcore/mrc/)


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

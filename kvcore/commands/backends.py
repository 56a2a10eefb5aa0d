"""``kvcore backends``: what is installed, each backend's options, and what failed to load."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from kvcore.commands.errors import EXIT_RUNTIME

__all__ = ["backends"]


def backends(
    as_json: Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")] = False,
) -> None:
    """List every backend (distribution, version, description, options) and device found (whether it is usable
    here and why not), and every plugin that failed to load. Exit status 1 when a plugin failed to load."""
    from kvcore.backend_options import describe_options
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
            "backends": [dict(s.to_json(), option_specs=describe_options(s.config)) for s in specs.values()],
            "devices": [d.to_json() for d in devices.values()],
            "failed": [f.to_json() for f in failures],
            "eviction_policies": available_eviction_policies(),
        }
        typer.echo(json.dumps(payload, indent=2))
    else:
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
    if failures:
        # CI reads the status: a plugin that did not load is a broken install.
        typer.echo(f"kvcore: {len(failures)} plugin(s) failed to load: "
                   f"{', '.join(f.plugin for f in failures)}", err=True)
        raise typer.Exit(EXIT_RUNTIME)

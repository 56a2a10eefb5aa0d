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
    """List every backend (distribution, version, description, options), device (whether it is usable here and
    why not) and engine target (the names engines give the backends, checked), and every plugin that failed to
    load. Exit status 1 when a plugin failed to load or an engine would refuse a target."""
    from kvcore.backend_options import describe_options
    from kvcore.engine_targets import engine_targets
    from kvcore.plugins import (
        available_backends,
        available_device_specs,
        available_eviction_policies,
        plugin_failures,
    )

    specs = available_backends()
    devices = available_device_specs()
    targets, target_failures = engine_targets()
    failures = plugin_failures() + target_failures
    refused = [t for t in targets if t.problem is not None]
    if as_json:
        payload = {
            "backends": [dict(s.to_json(), option_specs=describe_options(s.config)) for s in specs.values()],
            "devices": [d.to_json() for d in devices.values()],
            "targets": [t.to_json() for t in targets],
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
        if targets:
            typer.echo("engine targets (name -> backend, model kinds):")
        for t in targets:
            state = "" if t.problem is None else f" -- refused: {t.problem}"
            typer.echo(f"  {t.engine} {t.name} -> {t.backend} ({', '.join(t.serves) or '-'}; "
                       f"declared by {t.declared_by}){state}")
        for f in failures:
            typer.echo(f"failed: {f.plugin} ({f.distribution}): {f.error}")
    if failures or refused:
        # CI reads the status: a plugin that did not load, or a target an engine would refuse, is a broken install.
        what = []
        if failures:
            what.append(f"{len(failures)} plugin(s) failed to load: {', '.join(f.plugin for f in failures)}")
        if refused:
            what.append(f"{len(refused)} engine target(s) would be refused: {', '.join(t.name for t in refused)}")
        typer.echo("kvcore: " + "; ".join(what), err=True)
        raise typer.Exit(EXIT_RUNTIME)

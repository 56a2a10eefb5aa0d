"""``kvcore fuzz``: the command around :func:`kvcore.fuzz.run_fuzz`."""

from __future__ import annotations

from typing import Annotated

import typer

from kvcore.commands.errors import EXIT_RUNTIME, running_backend, usage_phase

__all__ = ["fuzz"]


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
    backend_opt: Annotated[
        list[str] | None,
        typer.Option(
            "--backend-opt", metavar="KEY=VALUE",
            help="An option of the backend's config (repeatable; `kvcore backends --json` lists them), "
            "e.g. --backend-opt eviction_policy=lfu.",
        ),
    ] = None,
) -> None:
    """Seeded random engine operations, bad inputs mixed in, the invariant checker every K operations.

    Exit status: 0 clean, 1 a failure (with its replay command), 2 a usage error.
    """
    from kvcore.backend_options import OptionError, parse_backend_opts
    from kvcore.fuzz import FuzzFailure, fuzz_config, run_fuzz
    from kvcore.plugins import get_backend

    with usage_phase():
        options: dict = {}
        for target, key, value in parse_backend_opts(backend_opt or []):
            if target is not None and target != backend:
                raise OptionError(f"--backend-opt {target}:{key}: the fuzz runs {backend!r} only")
            options[key] = value
        get_backend(backend)
        fuzz_config(backend, page_size, options)  # one line naming the option that a backend's config refuses

    def progress(done: int) -> None:
        typer.echo(f"kvcore fuzz: {done:,} / {ops:,} operations", err=True)

    try:
        with running_backend(backend):
            result = run_fuzz(backend, ops, seed, check_every=check_every, bad_rate=bad_rate, page_size=page_size,
                              backend_options=options, progress=progress)
    except FuzzFailure as exc:
        typer.echo(
            f"kvcore fuzz: FAILED: backend {exc.backend}, seed {exc.seed}, operation {exc.op}: {exc.what}", err=True
        )
        typer.echo(f"kvcore fuzz: replay: {exc.replay}", err=True)
        raise typer.Exit(EXIT_RUNTIME) from None
    bad = sum(v for k, v in result.counts.items() if k.startswith("bad: "))
    typer.echo(
        f"kvcore fuzz: backend {backend}, seed {seed}: {result.ops:,} operations ({bad:,} bad inputs refused), "
        f"{result.checks:,} invariant checks, clean, {result.seconds:.1f} s"
    )

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
        int | None, typer.Option(
            "--page-size", min=1,
            help="Page size (default: the backend's and 16, the operations split between the two runs).",
        )
    ] = None,
    backend_opt: Annotated[
        list[str] | None,
        typer.Option(
            "--backend-opt", metavar="KEY=VALUE",
            help="An option of the backend's config (repeatable; `kvcore backends --json` lists them), "
            "e.g. --backend-opt eviction_policy=lfu; strict=false and disable=true are refused.",
        ),
    ] = None,
) -> None:
    """Seeded random engine operations, bad inputs mixed in, the invariant checker every K operations.

    Without --page-size it runs at the backend's page size and at 16, the operations split between the two.
    Exit status: 0 clean, 1 a failure (with its replay command), 2 a usage error.
    """
    from kvcore.backend_options import OptionError, parse_backend_opts
    from kvcore.fuzz import FuzzFailure, fuzz_config, fuzz_page_sizes, run_fuzz, split_ops
    from kvcore.plugins import get_backend

    with usage_phase():
        options: dict = {}
        for target, key, value in parse_backend_opts(backend_opt or []):
            if target is not None and target != backend:
                raise OptionError(f"--backend-opt {target}:{key}: the fuzz runs {backend!r} only")
            options[key] = value
        get_backend(backend)
        sizes = fuzz_page_sizes(backend, page_size)
        for ps in sizes:
            fuzz_config(backend, ps, options)  # one line naming the option that a backend's config refuses

    done = 0

    def progress(n: int) -> None:
        typer.echo(f"kvcore fuzz: {done + n:,} / {ops:,} operations", err=True)

    results = []
    try:
        with running_backend(backend):
            for ps, share in zip(sizes, split_ops(ops, len(sizes))):
                results.append(run_fuzz(backend, share, seed, check_every=check_every, bad_rate=bad_rate,
                                        page_size=ps, backend_options=options, progress=progress))
                done += share
    except FuzzFailure as exc:
        typer.echo(f"kvcore fuzz: FAILED: {exc.where}: {exc.what}", err=True)
        typer.echo(f"kvcore fuzz: replay: {exc.replay}", err=True)
        raise typer.Exit(EXIT_RUNTIME) from None
    bad = sum(v for r in results for k, v in r.counts.items() if k.startswith("bad: "))
    pages = " + ".join(f"{r.ops:,} at page {r.page_size}" for r in results)
    typer.echo(
        f"kvcore fuzz: backend {backend}, seed {seed}: {ops:,} operations ({pages}; {bad:,} bad inputs refused), "
        f"{sum(r.checks for r in results):,} invariant checks, clean, {sum(r.seconds for r in results):.1f} s"
    )

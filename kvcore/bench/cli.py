"""The ``kvcore bench`` command (registered by kvcore.commands.app): options in, reports out; heavy imports inside.

The options are checked by :class:`kvcore.bench.options.BenchOptions` and resolved by
:func:`kvcore.bench.plan.plan_bench` before anything runs; errors there are usage errors
(exit status 2), a run that leaked is 3 (:mod:`kvcore.commands.errors`).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from typing import Annotated, Any

import typer

from kvcore.bench.workloads import WORKLOADS
from kvcore.commands.errors import EXIT_LEAK, UsageError, running_backend, usage_phase

__all__ = ["bench"]

_WORKLOAD_HELP = (
    ", ".join(WORKLOADS) + " (default: trace with --trace; "
    + "".join(f"{n} when every backend takes {w.favours}; " for n, w in WORKLOADS.items() if w.favours)
    + f"else {next(iter(WORKLOADS))})."
)


def _line_progress(name: str) -> Callable[[int, int], None]:
    """Progress for a stderr that is not a terminal: a line at once, then at most one a second, and at the end."""
    import time

    start = time.monotonic()
    last = [-1.0]

    def update(done: int, total: int) -> None:
        now = time.monotonic()
        if done < total and now - last[0] < 1.0:
            return
        last[0] = now
        typer.echo(f"kvcore bench: {name}: {done:,}/{total:,} requests, {now - start:,.0f} s", err=True)

    return update


def flags() -> dict[str, str]:
    """Each parameter's long option (``as_json`` -> ``--json``), for error messages: read from the signature."""
    import typing

    from typer.models import OptionInfo

    out: dict[str, str] = {}
    for name, hint in typing.get_type_hints(bench, include_extras=True).items():
        for meta in typing.get_args(hint)[1:]:
            if not isinstance(meta, OptionInfo):
                continue
            # With Annotated, typer keeps the first declaration in ``default``.
            decls = [d for d in (meta.default, *(meta.param_decls or ())) if isinstance(d, str) and d.startswith("-")]
            if decls:
                out[name] = max((d.split("/")[0] for d in decls), key=len)
    return out


def bench(
    backend: Annotated[
        list[str] | None,
        typer.Option(
            "--backend", "-b", metavar="NAME",
            help="Backend to run; repeat to compare several.",
        ),
    ] = None,
    compare: Annotated[
        str | None,
        typer.Option(
            "--compare",
            help="Comma-separated backends to run side by side (ratios against the first).",
        ),
    ] = None,
    device: Annotated[
        str,
        typer.Option(
            "--device",
            help=(
                "A registered device (`kvcore backends` lists them and whether each is usable here): cpu, "
                "cuda, cuda:N or a plugin's; off the CPU every prefill and decode writes real K/V."
            ),
        ),
    ] = "cpu",
    workload: Annotated[str | None, typer.Option("--workload", "-w", help=_WORKLOAD_HELP)] = None,
    trace: Annotated[
        str | None,
        typer.Option(
            "--trace",
            help="Mooncake JSONL trace to replay (implies --workload trace; default: the shipped sample).",
        ),
    ] = None,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the workload generator.")] = 0,
    num_requests: Annotated[
        int | None,
        typer.Option(
            "--num-requests", "-n",
            help="Requests to generate (trace: first N lines); default depends on the workload.",
        ),
    ] = None,
    as_json: Annotated[
        bool,
        typer.Option(
            "--json",
            help="Print the report as JSON (a list when several backends run).",
        ),
    ] = False,
    markdown: Annotated[bool, typer.Option("--markdown", help="Print the table as Markdown (for READMEs).")] = False,
    plot: Annotated[
        str | None,
        typer.Option(
            "--plot",
            help="Write pool occupancy and hit rate over time to this PNG (needs matplotlib).",
        ),
    ] = None,
    check_every: Annotated[
        int,
        typer.Option(
            "--check-every",
            help="Also run the invariant checker every N steps (0: only at the end).",
        ),
    ] = 0,
    size: Annotated[
        int | None,
        typer.Option(
            "--size",
            help=(
                "Token slots in the (full) KV pool (default 65536; a run with a sliding-window backend and no "
                "--size sizes pools from --model and --kv-budget instead)."
            ),
        ),
    ] = None,
    model: Annotated[
        str | None,
        typer.Option(
            "--model", metavar="NAME",
            help=(
                "Size every backend's pools from a model layout and --kv-budget, as SGLang does (presets: "
                "gpt-oss-120b, gpt-oss-20b, gemma-3-27b, gemma-3-12b). Default for runs with a sliding-window "
                "backend: gpt-oss-120b."
            ),
        ),
    ] = None,
    kv_budget: Annotated[
        str | None,
        typer.Option(
            "--kv-budget", metavar="BYTES",
            help="KV memory for --model sizing, e.g. 4GiB (default 4GiB); every backend gets the same bytes.",
        ),
    ] = None,
    swa_full_tokens_ratio: Annotated[
        float,
        typer.Option(
            "--swa-full-tokens-ratio",
            help="SGLang's swa_full_tokens_ratio for --model sizing: window-pool tokens per full-pool token, (0, 1].",
        ),
    ] = 0.8,
    release_window_lock: Annotated[
        bool,
        typer.Option(
            "--release-window-lock",
            help=(
                "Give back a request's prefix window lock once it decoded past the window (SGLang's "
                "SGLANG_OPT_SWA_RELEASE_LEAF_LOCK_AFTER_WINDOW, dec_swa_lock_only)."
            ),
        ),
    ] = False,
    retract_mode: Annotated[
        str,
        typer.Option(
            "--retract-mode",
            help="recompute: a retracted request is prefilled again; offload: its KV is copied to the host and "
            "loaded back without recompute (SGLang's decode-side retraction). The report counts the bytes.",
        ),
    ] = "recompute",
    pre_alloc_size: Annotated[
        int,
        typer.Option(
            "--pre-alloc-size",
            help="pd-decode: req_to_token rows for pre-allocated requests on top of --max-num-reqs "
            "(SGLang's DecodeReqToTokenPool).",
        ),
    ] = 0,
    transfer_steps: Annotated[
        int, typer.Option("--transfer-steps", help="pd-decode: steps a KV transfer from the prefill side takes.")
    ] = 4,
    page_size: Annotated[
        int | None,
        typer.Option(
            "--page-size",
            help="Tokens per page (default: the largest default of the backends and the device; 1 for most on cpu).",
        ),
    ] = None,
    max_num_reqs: Annotated[
        int,
        typer.Option(
            "--max-num-reqs",
            help="req_to_token rows: the most requests (and idle sessions) at once.",
        ),
    ] = 128,
    chunk_size: Annotated[
        int,
        typer.Option(
            "--chunk-size",
            help="Prefill token budget per step (chunked prefill).",
        ),
    ] = 2048,
    window: Annotated[
        int | None,
        typer.Option("--window", help="sliding_window_size for SWA backends (default: the model's, else 256)."),
    ] = None,
    swa_size: Annotated[
        int | None,
        typer.Option(
            "--swa-size",
            help="Window-pool slots for SWA backends (default: --size).",
        ),
    ] = None,
    swa_interval: Annotated[
        int,
        typer.Option(
            "--swa-interval",
            help=(
                "Free out-of-window slots once this many tokens slid out (SGLang's SGLANG_SWA_EVICTION_INTERVAL "
                "and its default); 1 keeps each request within W + 2 pages."
            ),
        ),
    ] = 128,
    sessions: Annotated[
        bool | None,
        typer.Option(
            "--sessions/--no-sessions",
            help="Run follow-up turns of multi-turn conversations on streaming sessions (default: on, unless a "
            "backend of the run cannot continue a conversation on one, such as a sparse-decode backend).",
        ),
    ] = None,
    eviction_policy: Annotated[
        str | None,
        typer.Option(
            "--eviction-policy",
            help="Eviction policy (lru, lfu, ...) for every backend whose config takes one; the others are named.",
        ),
    ] = None,
    step_ms: Annotated[
        float,
        typer.Option(
            "--step-ms",
            help="Trace replay: milliseconds of trace time per scheduler step.",
        ),
    ] = 20.0,
    reference: Annotated[
        str | None,
        typer.Option(
            "--reference", metavar="NAME",
            help=(
                "The backend to compare against: run alongside a single backend (default: the one its plugin "
                "names, else radix), or first in a comparison so the ratios are against it."
            ),
        ),
    ] = None,
    no_reference: Annotated[
        bool,
        typer.Option(
            "--no-reference",
            help="Run a single backend alone, without its reference.",
        ),
    ] = False,
    write_kv: Annotated[
        bool | None,
        typer.Option(
            "--write-kv/--no-write-kv",
            help="Write K/V bytes into the device buffer (default: on for cuda/npu).",
        ),
    ] = None,
    show_progress: Annotated[
        bool | None,
        typer.Option(
            "--progress/--no-progress",
            help=(
                "Progress on stderr from the first second: a bar on a terminal, else a line a second "
                "(default: on when stderr is a terminal and --json is not given)."
            ),
        ),
    ] = None,
    topk_locality: Annotated[
        float,
        typer.Option(
            "--topk-locality",
            help=(
                "Sparse-decode backends (hisparse): share of each step's top-k selection that is the most recent "
                "tokens; the rest is uniform over the older context (0: uniform, 1: only the most recent)."
            ),
        ),
    ] = 0.5,
    backend_opt: Annotated[
        list[str] | None,
        typer.Option(
            "--backend-opt", metavar="[BACKEND:]KEY=VALUE",
            help=(
                "An option of the backends' config (repeatable; `kvcore backends --json` lists them): to every "
                "backend of the run that takes it, or to BACKEND only; validated by the backend's own config."
            ),
        ),
    ] = None,
    host_size: Annotated[
        int, typer.Option("--host-size", help="Host-tier token slots under the device tree (radix, unified).")
    ] = 0,
    store: Annotated[
        str | None,
        typer.Option("--store", help="A KV store URL under the host tier (memory://, file:///dir, redis://host:port/0, "
                     "redis+cluster://host:port,...); --instances clears kvcore's keys in it first."),
    ] = None,
    instances: Annotated[
        int, typer.Option("--instances", help="Engine processes sharing --store, the workload split between them.")
    ] = 1,
    host_write_policy: Annotated[
        str, typer.Option("--host-write-policy", help="When device pages go to the host tier and --store (SGLang's "
                          "--hicache-write-policy): write_through, write_through_selective, write_back.")
    ] = "write_through",
) -> None:
    """Drive backends through a simulated continuous-batching serving loop and report hit rate, memory, speed and leaks.

    Exit status: 0; 1 when the run could not be done (a device not usable here, pools too small,
    a bug); 2 for a usage error (a bad option value, an unknown name); 3 when a run leaked slots or
    rows or broke an invariant (the report is still printed).
    """
    from pydantic import ValidationError

    from kvcore.backend_options import format_validation_error
    from kvcore.bench.options import BenchOptions
    from kvcore.bench.plan import plan_bench

    given: dict[str, Any] = dict(
        backend=list(backend or []), compare=compare, device=device, workload=workload, trace=trace, seed=seed,
        num_requests=num_requests, as_json=as_json, markdown=markdown, plot=plot, check_every=check_every,
        size=size, model=model, kv_budget=kv_budget, swa_full_tokens_ratio=swa_full_tokens_ratio,
        release_window_lock=release_window_lock, retract_mode=retract_mode, pre_alloc_size=pre_alloc_size,
        transfer_steps=transfer_steps, page_size=page_size, max_num_reqs=max_num_reqs, chunk_size=chunk_size,
        window=window, swa_size=swa_size, swa_interval=swa_interval, sessions=sessions,
        eviction_policy=eviction_policy, step_ms=step_ms, reference=reference, no_reference=no_reference,
        write_kv=write_kv, show_progress=show_progress, topk_locality=topk_locality,
        backend_opt=list(backend_opt or []),
        host_size=host_size, store=store, instances=instances, host_write_policy=host_write_policy,
    )
    with usage_phase():
        try:
            opts = BenchOptions(**given)
        except ValidationError as exc:
            raise ValueError(format_validation_error(exc, flags())) from None
        if opts.num_requests is not None and opts.num_requests >= 100_000 and not opts.as_json:
            typer.echo(f"kvcore bench: generating {opts.num_requests:,} requests, then running them "
                       "(this takes a while)", err=True)
        plan = plan_bench(opts)
    for note in plan.notes:
        typer.echo(f"kvcore bench: {note}", err=True)
    with usage_phase():
        from kvcore.bench.tiers import check_tier_options

        check_tier_options(opts.host_size, opts.store, opts.instances, plan.config["page_size"],
                           opts.host_write_policy)
    if opts.instances > 1:
        from kvcore.bench.instances import render_instances, run_instances

        if len(plan.names) > 1:
            raise UsageError("--instances runs one backend: give --backend alone")
        only = plan.names[0]
        with running_backend(only):
            rep = run_instances(only, opts.instances, workload=plan.workload.name, seed=opts.seed,
                                num_requests=opts.num_requests, trace=opts.trace, step_ms=opts.step_ms,
                                **plan.config)
        if opts.as_json:
            import json

            typer.echo(json.dumps(rep, indent=2))
        else:
            typer.echo(render_instances(rep))
        if rep["leaked_slots"] or rep["leaked_rows"] or rep["invariant_violations"]:
            typer.echo(f"kvcore: {only} failed the leak check over {opts.instances} instances", err=True)
            raise typer.Exit(EXIT_LEAK)
        return

    progress = None
    bar: Any = contextlib.nullcontext()
    show = opts.show_progress
    if show is None:
        show = sys.stderr.isatty() and not opts.as_json
    if show and not sys.stderr.isatty():
        progress = _line_progress
    elif show:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                       TimeElapsedColumn(), console=Console(stderr=True), transient=True)

        def progress(name: str) -> Callable[[int, int], None]:
            task = bar.add_task(name, total=None)

            def update(done: int, total: int) -> None:
                bar.update(task, completed=done, total=total)

            return update

    from kvcore.bench import run_bench

    reports: list[dict] = []
    with bar:
        for name in plan.run_names:
            with running_backend(name):
                reports += run_bench([name], workload=plan.workload, progress=progress,
                                     backend_options=plan.backend_options, **plan.config)
    if plan.with_reference:
        reports[-1]["_reference"] = True
    elif opts.reference is not None:
        reports[0]["_reference"] = True

    public = [{k: v for k, v in r.items() if not k.startswith("_")} for r in reports]
    # The results go out first: a plot that fails at the end must not take them with it.
    if opts.as_json:
        import json

        if plan.with_reference:
            payload: Any = dict(public[0], reference=public[1])
        elif len(plan.names) == 1:
            payload = public[0]
        else:
            payload = public
        typer.echo(json.dumps(payload, indent=2))
    elif opts.markdown:
        from kvcore.bench.report import render_markdown

        typer.echo(render_markdown(reports))
    else:
        from rich.console import Console

        from kvcore.bench.report import render_table

        Console(soft_wrap=True).print(render_table(reports))
    if opts.plot is not None:
        from kvcore.bench.plot import write_plot

        try:
            write_plot(reports, opts.plot)
        except OSError as exc:
            raise OSError(f"--plot {opts.plot!r}: {exc.strerror or exc}") from exc
    bad = [r for r in public if r["leaked_slots"] or r["leaked_rows"] or r["invariant_violations"]]
    for r in bad:
        why = "; ".join(r["violations"][:1]) or f"{r['leaked_slots']} slots, {r['leaked_rows']} rows leaked"
        typer.echo(f"kvcore: {r['backend']} failed the leak check: {why}", err=True)
    if bad:
        raise typer.Exit(EXIT_LEAK)

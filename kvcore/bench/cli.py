"""The ``kvcore bench`` command (registered by kvcore.cli); heavy imports happen inside."""

from __future__ import annotations

import contextlib
import sys
from typing import Annotated, Any

import typer

from kvcore.bench.workloads import WORKLOADS

__all__ = ["bench"]

_WORKLOAD_HELP = (
    ", ".join(WORKLOADS) + " (default: trace with --trace; "
    + "".join(f"{n} when every backend takes {w.favours}; " for n, w in WORKLOADS.items() if w.favours)
    + f"else {next(iter(WORKLOADS))})."
)


def _backend_list(backend: list[str] | None, compare: str | None) -> list[str]:
    names: list[str] = []
    for item in list(backend or []) + ([compare] if compare else []):
        for name in item.split(","):
            name = name.strip()
            if name in names:
                raise ValueError(f"backend {name!r} is named twice: compare different backends")
            if name:
                names.append(name)
    if not names:
        from kvcore.plugins import available_backends

        known = ", ".join(available_backends())
        raise ValueError(f"no backend given: use --backend NAME or --compare a,b (installed: {known})")
    return names


def _check_device(device: str) -> None:
    """One clear line for a device that is not registered (the choices) or not usable here (what is missing)."""
    from kvcore.devices import check_device

    check_device(device)


def _default_page_size(specs: list, device: str) -> int:
    """--page-size when not given: the largest default among the backends' configs and the device's."""
    from kvcore.devices import get_device

    sizes = [int(get_device(device).defaults.get("page_size", 1))]
    for spec in specs:
        default = spec.config.model_fields["page_size"].default
        sizes.append(default if isinstance(default, int) and default > 0 else 1)
    return max(sizes)


# Slot ids live in int32 req_to_token rows; more rows than this is no engine's batch.
_MAX_SLOTS = 2**31 - 2**16
_MAX_ROWS = 2**20
_MAX_REQUESTS = 10**7


def _check_limits(size: int, swa_size: int | None, max_num_reqs: int, num_requests: int | None) -> None:
    """Refuse pool and workload sizes this process cannot hold, before anything is allocated."""
    import os

    for opt, val in (("--size", size), ("--swa-size", swa_size)):
        if val is not None and val > _MAX_SLOTS:
            raise ValueError(f"{opt} {val:,} is more than {_MAX_SLOTS:,} slots (slot ids are int32)")
    if max_num_reqs > _MAX_ROWS:
        raise ValueError(f"--max-num-reqs {max_num_reqs:,} is more than {_MAX_ROWS:,} req_to_token rows")
    if num_requests is not None and num_requests > _MAX_REQUESTS:
        raise ValueError(f"--num-requests {num_requests:,} is more than {_MAX_REQUESTS:,}: run several seeds instead")
    # About 40 bytes of bookkeeping per slot (free ring, per-page counts, ownership, window mapping).
    need = 40 * (size + (swa_size or size))
    try:
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return
    if need > have:
        raise ValueError(
            f"--size {size:,} needs about {need / 2**30:,.0f} GiB of pool bookkeeping; this machine has "
            f"{have / 2**30:,.0f} GiB"
        )


_DEFAULT_SIZE = 65536


def _resolve_model(specs: list, model: str | None, kv_budget: str | None, size: int | None, swa_size: int | None,
                   page_size: int, ratio: float) -> tuple[str | None, list]:
    """The model that sizes the pools (None: --size does) and each backend's sizes, checked before anything runs.

    A run with a sliding-window backend (config field ``swa_size``) and neither --size nor
    --swa-size gets the default model, so the comparison is at equal memory.
    """
    from kvcore.bench.sizing import DEFAULT_KV_BUDGET, DEFAULT_SWA_MODEL, get_model, parse_bytes, size_pools

    if not 0 < ratio <= 1:
        raise ValueError(f"--swa-full-tokens-ratio must lie in (0, 1], got {ratio}")
    if model is None:
        if kv_budget is not None:
            raise ValueError("--kv-budget sizes pools for a --model: name one (e.g. --model gemma-3-27b)")
        windowed = any("swa_size" in spec.config.model_fields for spec in specs)
        if not windowed or size is not None or swa_size is not None:
            return None, []
        model = DEFAULT_SWA_MODEL
    elif size is not None or swa_size is not None:
        raise ValueError("--model sizes the pools from --kv-budget: drop --size/--swa-size, or drop --model")
    layout = get_model(model)
    budget = parse_bytes(kv_budget) if kv_budget is not None else DEFAULT_KV_BUDGET
    sizes = [size_pools(layout, budget, hybrid="swa_size" in spec.config.model_fields, page_size=page_size,
                        swa_full_tokens_ratio=ratio) for spec in specs]
    return model, sizes


def _line_progress(name: str):
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


def _check_plot(plot: str) -> None:
    """Refuse a --plot target that cannot be written, before the benchmark runs."""
    import importlib.util
    import os
    from pathlib import Path

    if not plot.lower().endswith(".png"):
        raise ValueError(f"--plot writes a PNG: give a file name ending in .png, not {plot!r}")
    folder = Path(plot).parent
    if not folder.is_dir():
        raise ValueError(f"--plot {plot!r}: folder {str(folder)!r} does not exist")
    if not os.access(folder, os.W_OK):
        raise ValueError(f"--plot {plot!r}: folder {str(folder)!r} is not writable")
    if importlib.util.find_spec("matplotlib") is None:
        raise ValueError("--plot needs matplotlib: pip install matplotlib")


def _why_missing(name: str) -> str:
    from kvcore.plugins import get_backend

    try:
        get_backend(name)
    except LookupError as exc:
        return str(exc)
    return "unknown"


def _positive(name: str, value: int | None, allow_zero: bool = False) -> None:
    if value is not None and (value < 0 or (value == 0 and not allow_zero)):
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else 'positive'}, got {value}")


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
        bool,
        typer.Option(
            "--sessions/--no-sessions",
            help="Run follow-up turns of multi-turn conversations on streaming sessions.",
        ),
    ] = True,
    eviction_policy: Annotated[
        str | None,
        typer.Option(
            "--eviction-policy",
            help="Eviction policy for tree backends (lru, lfu, ...).",
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
) -> None:
    """Drive backends through a simulated continuous-batching serving loop and report hit rate, memory, speed and leaks.

    Exit status: 0, or 2 when a run leaked slots or broke an invariant.
    """
    names = _backend_list(backend, compare)
    from kvcore.plugins import available_backends, get_backend

    specs = [get_backend(name) for name in names]  # BackendNotFound names the known ones
    if workload is None:
        from kvcore.bench.workloads import default_workload

        workload = default_workload([set(spec.config.model_fields) for spec in specs], trace)
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; choose one of: {', '.join(WORKLOADS)}")
    _check_device(device)
    if page_size is None:
        page_size = _default_page_size(specs, device)
    model, sizes = _resolve_model(specs, model, kv_budget, size, swa_size, page_size, swa_full_tokens_ratio)
    budget = None
    if model is not None:
        from kvcore.bench.sizing import DEFAULT_KV_BUDGET, parse_bytes

        budget = parse_bytes(kv_budget) if kv_budget is not None else DEFAULT_KV_BUDGET
    for opt, val in (("--size", size), ("--page-size", page_size), ("--max-num-reqs", max_num_reqs),
                     ("--chunk-size", chunk_size), ("--window", window), ("--swa-size", swa_size),
                     ("--swa-interval", swa_interval), ("--num-requests", num_requests)):
        _positive(opt, val)
    _positive("--check-every", check_every, allow_zero=True)
    _positive("--pre-alloc-size", pre_alloc_size, allow_zero=True)
    _positive("--transfer-steps", transfer_steps, allow_zero=True)
    from kvcore.bench.lifecycle import RETRACT_MODES

    if retract_mode not in RETRACT_MODES:
        raise ValueError(f"--retract-mode {retract_mode!r}: choose one of {', '.join(RETRACT_MODES)}")
    if not 0.0 <= topk_locality <= 1.0:
        raise ValueError(f"--topk-locality must lie in [0, 1], got {topk_locality}")
    if chunk_size % page_size:
        raise ValueError(f"--chunk-size {chunk_size} is not a multiple of --page-size {page_size}")
    if sizes:
        _check_limits(max(s.full for s in sizes), max((s.swa or 0 for s in sizes), default=0) or None,
                      max_num_reqs, num_requests)
    else:
        _check_limits(size or _DEFAULT_SIZE, swa_size, max_num_reqs, num_requests)
    if plot is not None:
        _check_plot(plot)
    from kvcore.bench.tiers import check_tier_options

    check_tier_options(host_size, store, instances, page_size)

    if reference is not None:
        get_backend(reference)

    from kvcore.bench import run_bench

    config = dict(
        device=device, size=size or _DEFAULT_SIZE, page_size=page_size, max_num_reqs=max_num_reqs,
        chunk_size=chunk_size,
        window=window, swa_size=swa_size, swa_interval=swa_interval, sessions=sessions, check_every=check_every,
        eviction_policy=eviction_policy, write_kv=write_kv, topk_locality=topk_locality,
        model=model, kv_budget=budget, swa_full_tokens_ratio=swa_full_tokens_ratio,
        release_window_lock=release_window_lock, retract_mode=retract_mode, pre_alloc_size=pre_alloc_size,
        transfer_steps=transfer_steps, host_size=host_size, store=store,
    )
    if instances > 1:
        from kvcore.bench.tiers import render_instances, run_instances

        if len(names) > 1:
            raise ValueError("--instances runs one backend: give --backend alone")
        rep = run_instances(names[0], instances, workload=workload, seed=seed, num_requests=num_requests,
                            trace=trace, step_ms=step_ms, **config)
        if as_json:
            import json

            typer.echo(json.dumps(rep, indent=2))
        else:
            typer.echo(render_instances(rep))
        if rep["leaked_slots"] or rep["leaked_rows"] or rep["invariant_violations"]:
            typer.echo(f"kvcore: {names[0]} failed the leak check over {instances} instances", err=True)
            raise typer.Exit(2)
        return
    run_names = list(names)
    with_reference = False
    if len(names) == 1 and not no_reference:
        # A backend alone runs with its reference: --reference, else what its plugin names, else radix.
        ref = reference or specs[0].reference or "radix"
        with_reference = ref != names[0] and ref in available_backends()
        if with_reference:
            run_names.append(ref)
        elif ref != names[0]:
            typer.echo(
                f"kvcore bench: the reference backend {ref!r} is not available ({_why_missing(ref)}); "
                f"running {names[0]} alone (--no-reference to say so, --reference NAME for another)",
                err=True,
            )
    elif reference is not None:
        # A comparison: the reference goes first, so every ratio is against it.
        names = run_names = [reference, *(n for n in names if n != reference)]

    progress = None
    bar: Any = contextlib.nullcontext()
    if show_progress is None:
        show_progress = sys.stderr.isatty() and not as_json
    if show_progress and not sys.stderr.isatty():
        progress = _line_progress
    elif show_progress:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                       TimeElapsedColumn(), console=Console(stderr=True), transient=True)

        def progress(name: str):
            task = bar.add_task(name, total=None)

            def update(done: int, total: int) -> None:
                bar.update(task, completed=done, total=total)

            return update

    if num_requests is not None and num_requests >= 100_000 and not as_json:
        typer.echo(f"kvcore bench: generating {num_requests:,} requests, then running them (this takes a while)",
                   err=True)
    with bar:
        reports = run_bench(run_names, workload=workload, seed=seed, num_requests=num_requests, trace=trace,
                            step_ms=step_ms, progress=progress, **config)
    if with_reference:
        reports[-1]["_reference"] = True
    elif reference is not None:
        reports[0]["_reference"] = True

    if plot is not None:
        from kvcore.bench.plot import write_plot

        write_plot(reports, plot)

    public = [{k: v for k, v in r.items() if not k.startswith("_")} for r in reports]
    if as_json:
        import json

        if with_reference:
            payload: Any = dict(public[0], reference=public[1])
        elif len(names) == 1:
            payload = public[0]
        else:
            payload = public
        typer.echo(json.dumps(payload, indent=2))
    elif markdown:
        from kvcore.bench.report import render_markdown

        typer.echo(render_markdown(reports))
    else:
        from rich.console import Console

        from kvcore.bench.report import render_table

        Console(soft_wrap=True).print(render_table(reports))
    bad = [r for r in public if r["leaked_slots"] or r["leaked_rows"] or r["invariant_violations"]]
    for r in bad:
        why = "; ".join(r["violations"][:1]) or f"{r['leaked_slots']} slots, {r['leaked_rows']} rows leaked"
        typer.echo(f"kvcore: {r['backend']} failed the leak check: {why}", err=True)
    if bad:
        raise typer.Exit(2)

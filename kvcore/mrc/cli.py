"""The ``kvcore mrc`` command (registered by kvcore.commands.app): data on stdout, diagnostics on stderr."""

from __future__ import annotations

import json
from typing import Annotated

import typer

__all__ = ["mrc", "parse_sizes", "parse_simulate"]


def parse_sizes(text: str) -> list[int]:
    """``"32768,65536,2^17"`` or ``"32K,64K"`` -> token counts (K = 1024 tokens)."""
    out = []
    for item in text.split(","):
        s = item.strip().lower()
        if not s:
            continue
        mult = 1
        if s.endswith("k"):
            s, mult = s[:-1], 1 << 10
        elif s.endswith("m"):
            s, mult = s[:-1], 1 << 20
        try:
            v = int(float(s) * mult)
        except ValueError:
            raise ValueError(f"--sizes: {item.strip()!r} is not a number of tokens (e.g. 32768 or 32K)") from None
        if v <= 0:
            raise ValueError(f"--sizes: {item.strip()!r} must be a positive number of tokens")
        out.append(v)
    if not out:
        raise ValueError("--sizes is empty: give sizes in tokens, e.g. --sizes 16K,64K,256K")
    return sorted(set(out))


def parse_simulate(text: str) -> list[tuple[str, str | None]]:
    """``"radix:lru,radix:lfu,swa"`` -> (backend, eviction policy or None) pairs."""
    out: list[tuple[str, str | None]] = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        backend, _, policy = item.partition(":")
        if not backend:
            raise ValueError(f"--simulate: {item!r} names no backend (write BACKEND or BACKEND:POLICY)")
        pair = (backend, policy or None)
        if pair in out:
            raise ValueError(f"--simulate: {item!r} is named twice")
        out.append(pair)
    if not out:
        raise ValueError("--simulate is empty: e.g. --simulate radix:lru,radix:lfu")
    return out


def mrc(
    workload: Annotated[
        str | None,
        typer.Option("--workload", "-w",
                     help="A bench workload (see `kvcore bench --help`; default zipf, or trace with --trace)."),
    ] = None,
    trace: Annotated[
        str | None, typer.Option("--trace", help="A Mooncake-format JSONL trace (run at block granularity).")
    ] = None,
    num_requests: Annotated[
        int | None, typer.Option("--num-requests", "-n", min=1, help="Requests (default: the workload's).")
    ] = None,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the workload generator.")] = 0,
    page_size: Annotated[int, typer.Option("--page-size", min=1, help="Page size in tokens.")] = 1,
    points: Annotated[int, typer.Option("--points", min=1, max=400, help="Cache sizes on the curve.")] = 40,
    simulate: Annotated[
        str | None,
        typer.Option("--simulate", help="Backends to run through `kvcore bench` at --sizes, e.g. radix:lru,radix:lfu "
                     "(BACKEND or BACKEND:EVICTION_POLICY); drawn as points."),
    ] = None,
    sizes: Annotated[
        str | None, typer.Option("--sizes", help="Cache sizes in tokens for --simulate, e.g. 16K,64K,256K.")
    ] = None,
    max_num_reqs: Annotated[
        int, typer.Option("--max-num-reqs", min=1, help="Running requests in the simulated runs.")
    ] = 128,
    model: Annotated[
        str, typer.Option("--model", help="Model layout for the GiB axis (kvcore.bench.sizing).")
    ] = "gpt-oss-120b",
    as_json: Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")] = False,
    plot: Annotated[str | None, typer.Option("--plot", help="Write the curves to this PNG (needs matplotlib).")] = None,
) -> None:
    """Hit rate at every cache size: LRU by stack distances, Belady's offline optimum, the infinite ceiling."""
    from kvcore.bench.sizing import get_model
    from kvcore.bench.workloads import make_workload
    from kvcore.commands.errors import usage_phase
    from kvcore.mrc.curve import compute_mrc
    from kvcore.mrc.simulate import simulate_points

    # Options, the workload or trace, and the page size: a mistake there is a usage error (one line, exit 2).
    with usage_phase():
        layout = get_model(model)
        if (simulate is None) != (sizes is None):
            raise ValueError("--simulate and --sizes go together: --simulate radix:lru --sizes 16K,64K")
        sim_sizes = parse_sizes(sizes) if sizes is not None else []
        sim = parse_simulate(simulate) if simulate is not None else []
        if plot is not None and not plot.lower().endswith(".png"):
            raise ValueError(f"--plot {plot!r}: write a .png file")
        if sim:
            from kvcore.plugins import available_backends
            from kvcore.tree import resolve_policy

            known = available_backends()
            for backend, policy in sim:
                if backend not in known:
                    raise ValueError(f"--simulate: unknown backend {backend!r}; installed: {', '.join(known)}")
                if policy is not None:
                    resolve_policy(policy)
        name = workload or ("trace" if trace is not None else "zipf")
        wl = make_workload(name, seed=seed, num_requests=num_requests, trace=trace)
        curve = compute_mrc(wl, page_size, points=points, extra_sizes=sim_sizes)
    if sim:
        curve.simulated = simulate_points(sim, sim_sizes, workload=name, seed=seed, num_requests=num_requests,
                                          trace=trace, page_size=page_size, max_num_reqs=max_num_reqs)
        longest = wl.max_total_len
        for p in curve.simulated:
            p["lru"], p["optimal"] = curve.at(p["size"])
            p["lower_bound"] = None
            if p["backend"] == "radix" and p["eviction_policy"] in (None, "lru"):
                # docs/bench.md "Agreement with the simulator" (radix under LRU): LRU(S - L) one request at a
                # time, else LRU(S - R - L).
                held = 0 if max_num_reqs == 1 else p["held_peak"]
                low = curve.lru_at([p["size"] - held - longest])[0]
                p["lower_bound"] = low / curve.prompt_tokens if curve.prompt_tokens else 0.0
    if plot is not None:
        from kvcore.mrc.plot import write_plot

        write_plot(curve, plot, layout)
        typer.echo(f"kvcore mrc: wrote {plot}", err=True)
    if as_json:
        typer.echo(json.dumps(curve.to_json(), indent=2))
        return
    typer.echo(f"workload {curve.workload}: {curve.requests:,} requests, {curve.prompt_tokens:,} prompt tokens, "
               f"page size {curve.page_size}; {curve.seconds:.2f} s")
    per_tok = layout.per_token_layer * (layout.full_layers + layout.swa_layers)
    typer.echo(f"{'size (tokens)':>14} {'GiB ' + layout.name:>22} {'LRU':>7} {'optimal':>8}")
    for s, a, b in zip(curve.sizes.tolist(), curve.lru.tolist(), curve.optimal.tolist()):
        typer.echo(f"{s:>14,} {s * per_tok / 2**30:>22.3f} {a:>7.1%} {b:>8.1%}")
    typer.echo(f"{'infinite':>14} {'':>22} {curve.infinite:>7.1%} {curve.infinite:>8.1%}")
    for p in curve.simulated:
        bound = "" if p["lower_bound"] is None else f", its lower bound {p['lower_bound']:.2%}"
        typer.echo(f"simulated {p['label']} at {p['size']:,} tokens: hit rate {p['hit_rate']:.2%} "
                   f"(LRU curve {p['lru']:.2%}{bound}, optimal {p['optimal']:.2%})")

"""The report: one JSON object per backend run (schema in docs/bench.md) and the terminal table."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvcore.bench.loop import BenchConfig
from kvcore.bench.metrics import RunResult
from kvcore.bench.sizing import DEFAULT_KV_BUDGET
from kvcore.bench.spec import Workload

if TYPE_CHECKING:
    from rich.table import Table

__all__ = ["SCHEMA_VERSION", "make_report", "render_table"]

SCHEMA_VERSION = 2  # 2: pools is a list of objects with a name (was a dict by pool name)


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    k = min(len(s) - 1, max(0, int(round(q * (len(s) - 1)))))
    return s[k]


def make_report(cfg: BenchConfig, workload: Workload, res: RunResult) -> dict[str, Any]:
    """The JSON object for one backend run; key order is part of the schema."""
    prompt = res.prompt_tokens
    wall = res.wall_s if res.wall_s > 0 else 1e-9
    tokens = res.prompt_tokens + res.output_tokens
    return {
        "schema_version": SCHEMA_VERSION,
        "backend": res.backend,
        "device": cfg.device,
        "workload": workload.name,
        "seed": workload.seed,
        "workload_digest": workload.digest,
        "num_requests": len(workload.requests),
        "prompt_tokens": prompt,
        "output_tokens": res.output_tokens,
        "cached_tokens": res.cached_tokens,
        "hit_rate": res.cached_tokens / prompt if prompt else 0.0,
        "infinite_cache_hit_rate": res.infinite_cached_tokens / prompt if prompt else 0.0,
        "pools": res.pools,
        "window_per_request_peak": res.window_per_request_peak,
        "window_bound": (res.window_size + cfg.swa_interval - 1 + 2 * cfg.page_size
                         if res.window_size is not None else None),
        "running_peak": res.running_peak,
        "retractions": res.retractions,
        "retract_mode": cfg.retract_mode,
        "retract_offload_bytes": res.retract_offload_bytes,
        "retract_offload_tokens": res.retract_offload_tokens,
        "retract_loaded_tokens": res.retract_loaded_tokens,
        "retract_recomputed_tokens": res.retract_recomputed_tokens,
        "pd_preallocated": res.pd_preallocated,
        "pd_wait_steps_mean": res.pd_wait_steps / res.pd_preallocated if res.pd_preallocated else None,
        "evictions": res.evictions,
        "swa_evictions": res.swa_evictions,
        "evict_calls": res.evict_calls,
        "session_releases": res.session_releases,
        "steps": res.steps,
        "wall_s": res.wall_s,
        "backend_s": res.backend_s,
        "loop_overhead_s": max(0.0, res.wall_s - res.backend_s - res.kv_write_s),
        "kv_write_s": res.kv_write_s,
        "kv_bytes_written": res.kv_bytes_written,
        "tokens_per_step": tokens / res.steps if res.steps else 0.0,
        "window_lock_releases": res.window_lock_releases,
        "requests_per_s": len(workload.requests) / wall,
        "tokens_per_s": tokens / wall,
        "step_p50_us": _pct(res.step_us, 0.50),
        "step_p99_us": _pct(res.step_us, 0.99),
        "step_mean_us": statistics.fmean(res.step_us) if res.step_us else 0.0,
        "backend_stats": dict(res.backend_stats),
        "leaked_slots": res.leaked_slots,
        "leaked_rows": res.leaked_rows,
        "invariant_checks": res.checks,
        "invariant_violations": res.invariant_violations,
        "violations": list(res.violations),
        "options": {k: v for k, v in res.options.items() if k != "kv_buffer"}
        | {"chunk_size": cfg.chunk_size, "sessions": cfg.sessions, "swa_interval": cfg.swa_interval,
           "model": cfg.model, "kv_budget": (cfg.kv_budget or DEFAULT_KV_BUDGET) if cfg.model else None,
           "swa_full_tokens_ratio": cfg.swa_full_tokens_ratio if cfg.model else None,
           "release_window_lock": cfg.release_window_lock},
        "workload_params": workload.params,
    }


# rows of the table: (label, getter, format, higher_is_better or None for no ratio)
def _pool(name: str, key: str) -> Callable[[dict], Any]:
    def get(r: dict) -> Any:
        for p in r["pools"]:
            if p["name"] == name:
                return p.get(key)
        return None

    return get


def _pool_names(reports: list[dict]) -> list[str]:
    """Every pool of every report, in first-seen order."""
    names: list[str] = []
    for r in reports:
        for p in r["pools"]:
            if p["name"] not in names:
                names.append(p["name"])
    return names


_HEAD = [
    ("hit rate", lambda r: r["hit_rate"], "{:.1%}", True),
    ("infinite-cache hit rate", lambda r: r["infinite_cache_hit_rate"], "{:.1%}", None),
    ("cached tokens", lambda r: r["cached_tokens"], "{:,}", True),
]
_TAIL = [
    ("window slots per decoding request (peak)", lambda r: r["window_per_request_peak"], "{:,}", None),
    ("  bound: W + interval - 1 + 2 pages", lambda r: r["window_bound"], "{:,}", None),
    ("running requests (peak)", lambda r: r["running_peak"], "{:,}", True),
    ("retractions", lambda r: r["retractions"], "{:,}", False),
    ("  offloaded to host (bytes)", lambda r: r.get("retract_offload_bytes") or None, "{:,}", None),
    ("  positions resumed without recompute", lambda r: r.get("retract_loaded_tokens") or None, "{:,}", True),
    ("  positions prefilled again", lambda r: r.get("retract_recomputed_tokens") or None, "{:,}", False),
    ("pd: steps until pre-allocated (mean)", lambda r: r.get("pd_wait_steps_mean"), "{:,.1f}", False),
    ("evicted slots", lambda r: r["evictions"], "{:,}", False),
    ("steps", lambda r: r["steps"], "{:,}", False),
    ("tokens per step (simulated throughput)", lambda r: r["tokens_per_step"], "{:,.0f}", True),
    ("wall s", lambda r: r["wall_s"], "{:.2f}", False),
    ("backend s", lambda r: r["backend_s"], "{:.2f}", False),
    ("loop overhead s", lambda r: r["loop_overhead_s"], "{:.2f}", False),
    ("requests/s", lambda r: r["requests_per_s"], "{:,.0f}", True),
    ("tokens/s", lambda r: r["tokens_per_s"], "{:,.0f}", True),
    ("step p50 µs", lambda r: r["step_p50_us"], "{:,.0f}", False),
    ("step p99 µs", lambda r: r["step_p99_us"], "{:,.0f}", False),
    ("leaked slots", lambda r: r["leaked_slots"], "{:,}", None),
    ("invariant violations", lambda r: r["invariant_violations"], "{:,}", None),
]


def _stat_names(reports: list[dict]) -> list[str]:
    """Every backend counter of every report, in first-seen order."""
    names: list[str] = []
    for r in reports:
        for name in r.get("backend_stats", {}):
            if name not in names:
                names.append(name)
    return names


def _rows(reports: list[dict]) -> list:
    pools = []
    for name in _pool_names(reports):
        pools.append((f"peak {name} slots (live)", _pool(name, "peak"), "{:,}", False))
        pools.append((f"peak {name} slots (with cache)", _pool(name, "peak_occupied"), "{:,}", False))
    stats = [
        (name.replace("_", " "), lambda r, n=name: r.get("backend_stats", {}).get(n), "{:,}", None)
        for name in _stat_names(reports)
    ]
    return [*_HEAD, *pools, *_TAIL[:-2], *stats, *_TAIL[-2:]]


def table_rows(reports: list[dict]) -> list[list[str]]:
    """Metric rows, one column per report; numbers after the first carry their ratio to the first."""
    rows = []
    base = reports[0]
    for label, get, fmt, better in _rows(reports):
        values = [get(r) for r in reports]
        if all(v is None for v in values):
            continue
        cells = [label]
        b = get(base)
        for i, v in enumerate(values):
            if v is None:
                cells.append("-")
                continue
            text = fmt.format(v)
            if i and better is not None and isinstance(b, (int, float)) and b:
                text += f" ({v / b:.2f}x)"
            cells.append(text)
        rows.append(cells)
    return rows


def render_table(reports: list[dict], title: str | None = None) -> Table:
    """A rich Table with the metrics as rows and the backends as columns."""
    from rich.table import Table

    first = reports[0]
    if title is None:
        title = (
            f"kvcore bench: {first['workload']} workload, {first['num_requests']} requests, seed {first['seed']}, "
            f"device {first['device']} (digest {first['workload_digest'][:12]})"
        )
        opts = first.get("options", {})
        if opts.get("model"):
            title += (f"; pools sized for {opts['model']} in {opts['kv_budget'] / 2**30:.3g} GiB of KV "
                      f"(swa_full_tokens_ratio {opts['swa_full_tokens_ratio']})")
    table = Table(title=title)
    table.add_column("metric")
    for r in reports:
        table.add_column(r["backend"] + (" (reference)" if r.get("_reference") else ""), justify="right")
    for cells in table_rows(reports):
        table.add_row(*cells)
    return table


def render_markdown(reports: list[dict]) -> str:
    head = "| metric | " + " | ".join(r["backend"] for r in reports) + " |"
    sep = "|---|" + "---:|" * len(reports)
    body = ["| " + " | ".join(cells) + " |" for cells in table_rows(reports)]
    return "\n".join([head, sep, *body])

"""``kvcore bench --instances K``: K engine processes, each with its own device tree, on one shared store.

The workload is split by session (a multi-turn conversation stays on one instance, as
a router with session affinity sends it) or by request, and the combined hit rate is
reported beside the one-big-cache infinite hit rate and the best K isolated caches
could reach.  Each instance is one serving loop (:mod:`kvcore.bench.loop`) with its
tiers (:mod:`kvcore.bench.tiers`) and its report (:mod:`kvcore.bench.report`).
"""

from __future__ import annotations

import multiprocessing
import time
from typing import Any

from kvcore.bench.loop import BenchConfig, infinite_cache_hits, run_workload
from kvcore.bench.report import make_report
from kvcore.bench.spec import Workload
from kvcore.bench.tiers import STORE_KEYS, report_fields
from kvcore.bench.workloads import make_workload

__all__ = ["render_instances", "run_instances", "run_share", "split_workload"]


def split_workload(workload: Workload, instances: int) -> list[Workload]:
    """K shares of ``workload``: whole sessions (or single requests) dealt round-robin in arrival order."""
    groups: dict[str, int] = {}
    shares: list[list] = [[] for _ in range(instances)]
    for spec in workload.requests:
        group = spec.session_id if spec.session_id is not None else f"req:{spec.rid}"
        if group not in groups:
            groups[group] = len(groups) % instances
        shares[groups[group]].append(spec)
    return [Workload(f"{workload.name}[{i}/{instances}]", workload.seed, reqs, dict(workload.params))
            for i, reqs in enumerate(shares)]


def run_share(index: int, instances: int, backend: str, workload_name: str, seed: int, num_requests: int | None,
              trace: str | None, step_ms: float, config: dict[str, Any]) -> dict[str, Any]:
    """One engine: share ``index`` of ``instances`` of the workload on its own cache (the store is shared)."""
    wl = make_workload(workload_name, seed=seed, num_requests=num_requests, trace=trace, step_ms=step_ms)
    share = split_workload(wl, instances)[index]
    cfg = BenchConfig(backend=backend, **config)
    res = run_workload(cfg, share)
    rep = make_report(cfg, share, res)
    rep.update(report_fields(res.tiers, res.cached_tokens))
    rep["instance"] = index
    rep["requests"] = len(share.requests)
    return rep


def run_instances(backend: str, instances: int, *, workload: str, seed: int, num_requests: int | None,
                  trace: str | None, step_ms: float, **config: Any) -> dict[str, Any]:
    """K engine processes on one shared store (cleared of kvcore's keys first); the combined report."""
    store_url = config.get("store")
    if store_url is not None:
        from kvcore.stores import open_store

        with open_store(store_url) as store:
            store.clear()
    wl = make_workload(workload, seed=seed, num_requests=num_requests, trace=trace, step_ms=step_ms)
    page = int(config.get("page_size", 1))
    prompt = wl.prompt_tokens
    jobs = [(i, instances, backend, workload, seed, num_requests, trace, step_ms, config) for i in range(instances)]
    t = time.perf_counter()
    # spawn: a forked child of a process that already ran torch threads can hang.
    with multiprocessing.get_context("spawn").Pool(instances) as pool:
        reports = pool.starmap(run_share, jobs)
    wall = time.perf_counter() - t
    cached = sum(r["cached_tokens"] for r in reports)
    isolated = sum(infinite_cache_hits(share, page) for share in split_workload(wl, instances))
    tiers = {k: sum(r.get("tiers", {}).get(k, 0) for r in reports)
             for k in ("device_hit_tokens", "host_hit_tokens", "store_hit_tokens", "bytes_to_device",
                       "bytes_from_device", "store_written_pages", "store_failed_pages", "written_back_pages")}
    out: dict[str, Any] = {
        "backend": backend,
        "workload": workload,
        "instances": instances,
        "store_url": store_url,
        "requests": len(wl.requests),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_rate": cached / prompt if prompt else 0.0,
        "infinite_cache_hit_rate": infinite_cache_hits(wl, page) / prompt if prompt else 0.0,
        "isolated_infinite_hit_rate": isolated / prompt if prompt else 0.0,
        "tiers": tiers,
        "wall_s": wall,
        "leaked_slots": sum(r["leaked_slots"] for r in reports),
        "leaked_rows": sum(r["leaked_rows"] for r in reports),
        "invariant_violations": sum(r["invariant_violations"] for r in reports),
        "per_instance": [
            {k: r.get(k) for k in ("instance", "requests", "hit_rate", "cached_tokens", "wall_s", "tiers", "store",
                                   "leaked_slots", "invariant_violations")}
            for r in reports
        ],
    }
    if store_url is not None:
        out["store"] = {k: sum(r.get("store", {}).get(k, 0) for r in reports) for k in STORE_KEYS}
    return out


def render_instances(rep: dict[str, Any]) -> str:
    """The text report of an ``--instances`` run."""
    t = rep["tiers"]
    lines = [
        f"{rep['backend']} x {rep['instances']} instances, workload {rep['workload']}, store {rep['store_url']}",
        f"  hit rate (combined)            {rep['hit_rate']:.1%}",
        f"  infinite-cache hit rate        {rep['infinite_cache_hit_rate']:.1%}  (one cache sees every request)",
        f"  isolated infinite hit rate     {rep['isolated_infinite_hit_rate']:.1%}  (K caches, nothing shared)",
        f"  hits: device {t['device_hit_tokens']:,}  host {t['host_hit_tokens']:,}  store {t['store_hit_tokens']:,}"
        " tokens",
        f"  bytes: to device {t['bytes_to_device']:,}  from device {t['bytes_from_device']:,}",
    ]
    if "store" in rep:
        s = rep["store"]
        lines.append(f"  store: hits {s['hits']:,}  misses {s['misses']:,}  errors {s['errors']:,}  "
                     f"read {s['bytes_read']:,} B  written {s['bytes_written']:,} B  round trips {s['round_trips']:,}")
    for r in rep["per_instance"]:
        lines.append(f"  instance {r['instance']}: hit rate {r['hit_rate']:.1%}, store hits "
                     f"{r['tiers']['store_hit_tokens'] if r.get('tiers') else 0:,} tokens, wall {r['wall_s']:.2f} s")
    lines.append(f"  leaked slots {rep['leaked_slots']}, invariant violations {rep['invariant_violations']}, "
                 f"wall {rep['wall_s']:.2f} s")
    return "\n".join(lines)

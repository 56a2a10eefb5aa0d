"""The bench's side of the tiers: ``--host-size``, ``--store``, ``--host-write-policy`` and ``--instances K``.

One run with tiers flushes the store writes at the end of every step (never on
the match path) and reports device, host and store hits separately, the bytes
moved and the store's counters (JSON ``store``; the ``host`` pool is in
``pools`` like any other).  ``--instances K`` runs K engine processes, each with
its own device tree, on one shared store: the workload is split by session (a
multi-turn conversation stays on one instance, as a router with session affinity
sends it) or by request, and the combined hit rate is reported beside the
one-big-cache infinite hit rate and the best K isolated caches could reach.
"""

from __future__ import annotations

import multiprocessing
import time
from typing import Any

from kvcore.bench.spec import Workload
from kvcore.tiers import TieredCacheMixin

__all__ = [
    "BenchTiers", "check_tier_options", "render_instances", "report_fields", "run_instances", "run_share",
    "split_workload", "tier_options",
]

_STORE_KEYS = ("hits", "misses", "errors", "bytes_read", "bytes_written", "round_trips")


def check_tier_options(host_size: int, store: str | None, instances: int, page_size: int,
                       host_write_policy: str = "write_through") -> None:
    """Refuse bad ``--host-size`` / ``--store`` / ``--instances`` before anything runs (ValueError, one line);
    the backend's config checks ``--host-write-policy``'s name, here only that it has a tier to write to."""
    if host_size < 0 or host_size % page_size:
        raise ValueError(f"--host-size {host_size} must be a non-negative multiple of --page-size {page_size}")
    if host_write_policy != "write_through" and not (host_size or store):
        raise ValueError(f"--host-write-policy {host_write_policy} needs a tier to write to: "
                         "give --host-size or --store")
    if instances < 1:
        raise ValueError(f"--instances must be at least 1, got {instances}")
    if store is not None:
        from kvcore.stores.registry import StoreURL, available_stores

        url = StoreURL.parse(store)
        if url.scheme not in available_stores():
            known = ", ".join(s + "://" for s in available_stores())
            raise ValueError(f"--store {store!r}: no store for scheme {url.scheme + '://'!r}; known: {known}")
        if instances > 1 and url.scheme == "memory":
            raise ValueError("--instances runs separate processes: a memory:// store is private to one; "
                             "use file:///dir or redis://host:port/0")


def tier_options(backend: str, fields: set[str], host_size: int, store: str | None,
                 host_write_policy: str = "write_through") -> dict[str, Any]:
    """The create_cache options for the tiers; a backend without them is refused, naming it."""
    opts: dict[str, Any] = {}
    if host_size:
        opts["host_size"] = host_size
    if store is not None:
        opts["store"] = store
    if opts and host_write_policy != "write_through":
        opts["host_write_policy"] = host_write_policy
    if opts and not {"host_size", "store"} <= fields:
        raise ValueError(f"backend {backend!r} takes no host tier or store (--host-size, --store); radix and "
                         "unified do")
    return opts


class BenchTiers:
    """Flushes a tiered cache's store writes after each step and collects its counters at the end."""

    def __init__(self, cache: TieredCacheMixin) -> None:
        self.cache = cache
        self.flush_s = 0.0

    @classmethod
    def attach(cls, cache: Any) -> BenchTiers | None:
        return cls(cache) if isinstance(cache, TieredCacheMixin) else None

    def after_step(self) -> None:
        t = time.perf_counter()
        self.cache.flush()
        self.flush_s += time.perf_counter() - t

    def finish(self) -> dict[str, Any]:
        self.after_step()
        stats = self.cache.tier_stats()
        stats["store_flush_s"] = self.flush_s
        return stats


def report_fields(tiers: dict[str, Any], cached_tokens: int) -> dict[str, Any]:
    """JSON ``store`` (the store's counters) and ``tiers`` (hits by tier, bytes moved) of one run."""
    if not tiers:
        return {}
    host = int(tiers.get("host_hit_tokens", 0))
    store_hits = int(tiers.get("store_hit_tokens", 0))
    out: dict[str, Any] = {"tiers": {
        "device_hit_tokens": cached_tokens - host - store_hits,
        "host_hit_tokens": host,
        "store_hit_tokens": store_hits,
        "bytes_to_device": int(tiers.get("bytes_host_to_device", 0)),
        "bytes_from_device": int(tiers.get("bytes_device_to_host", 0)),
        "store_written_pages": int(tiers.get("store_written_pages", 0)),
        "store_failed_pages": int(tiers.get("store_failed_pages", 0)),
        "written_back_pages": int(tiers.get("written_back_pages", 0)),
        "store_flush_s": float(tiers.get("store_flush_s", 0.0)),
    }}
    if "store" in tiers:
        out["store"] = {k: int(tiers["store"].get(k, 0)) for k in _STORE_KEYS}
    return out


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
    from kvcore.bench.loop import BenchConfig, run_workload
    from kvcore.bench.report import make_report
    from kvcore.bench.workloads import make_workload

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
    from kvcore.bench.loop import infinite_cache_hits
    from kvcore.bench.workloads import make_workload

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
        out["store"] = {k: sum(r.get("store", {}).get(k, 0) for r in reports) for k in _STORE_KEYS}
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

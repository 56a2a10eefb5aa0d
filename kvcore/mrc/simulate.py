"""Simulated points beside the curves: backends run through ``kvcore bench`` at chosen sizes."""

from __future__ import annotations

from typing import Any

__all__ = ["simulate_points"]


def simulate_points(backends: list[tuple[str, str | None]], sizes: list[int], *, workload: str, seed: int = 0,
                    num_requests: int | None = None, trace: str | None = None, page_size: int = 1,
                    max_num_reqs: int = 128, **config: Any) -> list[dict[str, Any]]:
    """One point per (backend, policy) and size: the bench report's hit rate and what it locked."""
    from kvcore.bench import run_bench

    out = []
    for backend, policy in backends:
        for size in sizes:
            cfg: dict[str, Any] = dict(size=size, page_size=page_size, max_num_reqs=max_num_reqs, **config)
            if policy is not None:
                cfg["eviction_policy"] = policy
            rep = run_bench([backend], workload=workload, seed=seed, num_requests=num_requests, trace=trace,
                            **cfg)[0]
            out.append({
                "backend": backend, "eviction_policy": policy,
                "label": backend if policy is None else f"{backend} {policy}",
                "size": size, "hit_rate": rep["hit_rate"], "cached_tokens": rep["cached_tokens"],
                "evictions": rep["evictions"], "retractions": rep["retractions"],
                "held_peak": rep["pools"][0]["peak"],
            })
    return out

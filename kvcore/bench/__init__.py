"""``kvcore bench``: drive a backend through a simulated serving loop and report on it.

Import cost stays low: the loop, the workloads and matplotlib load on use.
"""

from __future__ import annotations

from typing import Any

__all__ = ["run_bench", "WORKLOAD_NAMES"]


def __getattr__(name: str) -> Any:
    if name == "WORKLOAD_NAMES":  # the registry's names (kvcore.bench.workloads.WORKLOADS), loaded on use
        from kvcore.bench.workloads import WORKLOADS

        return tuple(WORKLOADS)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def run_bench(backends: list[str], *, workload: str = "shared-prefix", seed: int = 0, num_requests: int | None = None,
              trace: str | None = None, step_ms: float = 20.0, progress=None, **config: Any) -> list[dict]:
    """Run one workload through each backend; returns one report dict per backend (see docs/bench.md).

    ``config`` holds :class:`kvcore.bench.loop.BenchConfig` fields (size, page_size, ...).
    Each report also carries its per-step timeline under the private key ``_timeline``.
    """
    from kvcore.bench.loop import BenchConfig, run_workload
    from kvcore.bench.report import make_report
    from kvcore.bench.tiers import report_fields
    from kvcore.bench.workloads import make_workload

    wl = make_workload(workload, seed=seed, num_requests=num_requests, trace=trace, step_ms=step_ms)
    reports = []
    for name in backends:
        cfg = BenchConfig(backend=name, **config)
        res = run_workload(cfg, wl, progress=progress(name) if progress else None)
        rep = make_report(cfg, wl, res)
        rep.update(report_fields(res.tiers, res.cached_tokens))
        rep["_timeline"] = res.timeline
        reports.append(rep)
    return reports

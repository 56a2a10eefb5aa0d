"""``kvcore bench``: drive a backend through a simulated serving loop and report on it.

Import cost stays low: the loop, the workloads and matplotlib load on use.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvcore.bench.spec import Workload

__all__ = ["run_bench", "WORKLOAD_NAMES"]


def __getattr__(name: str) -> Any:
    if name == "WORKLOAD_NAMES":  # the registry's names (kvcore.bench.workloads.WORKLOADS), loaded on use
        from kvcore.bench.workloads import WORKLOADS

        return tuple(WORKLOADS)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def run_bench(backends: list[str], *, workload: str | Workload = "shared-prefix", seed: int = 0,
              num_requests: int | None = None, trace: str | None = None, step_ms: float = 20.0,
              progress: Callable[[str], Callable[[int, int], None]] | None = None,
              backend_options: dict[str, dict[str, Any]] | None = None, **config: Any) -> list[dict]:
    """Run one workload through each backend; returns one report dict per backend (see docs/bench.md).

    ``workload`` is a registered name (built from ``seed``, ``num_requests``, ``trace`` and
    ``step_ms``) or a built :class:`~kvcore.bench.spec.Workload`.  ``config`` holds
    :class:`kvcore.bench.loop.BenchConfig` fields (size, page_size, ...) and
    ``backend_options`` more create_cache options per backend name.  Each report also
    carries its per-step timeline under the private key ``_timeline``.
    """
    from kvcore.bench.loop import BenchConfig, run_workload
    from kvcore.bench.report import make_report
    from kvcore.bench.tiers import report_fields
    from kvcore.bench.workloads import make_workload

    if isinstance(workload, str):
        wl = make_workload(workload, seed=seed, num_requests=num_requests, trace=trace, step_ms=step_ms)
    else:
        wl = workload
    reports = []
    for name in backends:
        cfg = BenchConfig(backend=name, backend_options=dict((backend_options or {}).get(name, {})), **config)
        result = run_workload(cfg, wl, progress=progress(name) if progress else None)
        rep = make_report(cfg, wl, result)
        rep.update(report_fields(result.tiers, result.cached_tokens))
        rep["_timeline"] = result.timeline
        reports.append(rep)
    return reports

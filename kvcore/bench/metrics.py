"""What a run measures: counters, per-step pool samples, and the :class:`RunResult` they add up to.

Pools are read by name through ``cache.pools()`` and ``cache.cached_sizes()``, so a
backend with a pool of a new kind shows up in the report, the JSON ``pools``
list and the plot without a change here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["RunResult", "Metrics"]


@dataclass
class RunResult:
    backend: str
    options: dict
    steps: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    infinite_cached_tokens: int = 0
    retractions: int = 0
    evictions: int = 0
    swa_evictions: int = 0
    evict_calls: int = 0
    session_releases: int = 0
    # --retract-mode offload: bytes / positions copied to the host at retraction, positions loaded back
    retract_offload_bytes: int = 0
    retract_offload_tokens: int = 0
    retract_loaded_tokens: int = 0
    retract_recomputed_tokens: int = 0  # positions prefilled again after a recompute retraction
    # --workload pd-decode: requests pre-allocated, and the steps they waited for it (the prefill side blocked)
    pd_preallocated: int = 0
    pd_wait_steps: int = 0
    window_lock_releases: int = 0  # --release-window-lock: prefix window locks given back after the window
    running_peak: int = 0  # the most requests decoding at once
    wall_s: float = 0.0
    backend_s: float = 0.0
    kv_write_s: float = 0.0
    kv_bytes_written: int = 0
    check_s: float = 0.0
    step_us: list[float] = field(default_factory=list)
    # One entry per pool, in cache.pools() order: name, capacity, available, evictable,
    # protected, leaked (after the run), peak, peak_occupied (over the run).
    pools: list[dict] = field(default_factory=list)
    leaked_slots: int = 0
    leaked_rows: int = 0
    invariant_violations: int = 0
    violations: list[str] = field(default_factory=list)
    checks: int = 0
    # Set when the backend has a windowed pool: the most window slots one decoding request
    # holds (after a window free, plus the tokens it decodes before the next one).
    window_per_request_peak: int | None = None
    window_size: int | None = None
    # The backend's own counters (cache.stats()): copies made, tokens swapped in, ...
    backend_stats: dict = field(default_factory=dict)
    # Host tier and store counters (kvcore.bench.tiers), when the backend runs with them.
    tiers: dict = field(default_factory=dict)
    timeline: dict = field(default_factory=dict)


class Metrics:
    """Counters and samples of one run over ``cache`` (the backend itself, not a session wrapper)."""

    def __init__(self, backend: str, options: dict, cache: Any) -> None:
        self.cache = cache
        self.result = RunResult(backend=backend, options=options)
        views = cache.pools()
        self._pools = [(v.name, v.allocator, v.capacity) for v in views]
        self.capacities = {name: cap for name, _, cap in self._pools}
        self.peak = {name: 0 for name in self.capacities}
        self.peak_occ = {name: 0 for name in self.capacities}
        self.tl: dict[str, list] = {"step": [], "hit_rate": []}
        self._series = []
        for name in self.capacities:
            used: list[int] = []
            live: list[int] = []
            self.tl[f"{name}_used"] = used
            self.tl[f"{name}_live"] = live
            self._series.append((used, live))
        self._cum_prompt = 0
        self._cum_cached = 0

    # ------------------------------------------------------------ counters
    def count_evict(self, r: Any) -> None:
        """``Engine(on_evict=...)``: one ``make_room`` call and what it evicted."""
        result = self.result
        result.evict_calls += 1
        if r is not None:
            result.evictions += r.num_tokens_evicted
            result.swa_evictions += r.swa_num_tokens_evicted

    def request_done(self, prompt_len: int, cached: int) -> None:
        self._cum_prompt += prompt_len
        self._cum_cached += cached
        self.result.cached_tokens += cached

    def window_held(self, held: int) -> None:
        result = self.result
        if result.window_per_request_peak is None or held > result.window_per_request_peak:
            result.window_per_request_peak = held

    # ------------------------------------------------------------ samples
    def sample(self, step: int) -> None:
        """Pool occupancy after a decode step: slots not free (``used``) and not evictable (``live``)."""
        sizes = self.cache.cached_sizes()
        tl = self.tl
        tl["step"].append(step)
        tl["hit_rate"].append(self._cum_cached / self._cum_prompt if self._cum_prompt else 0.0)
        peak, peak_occ = self.peak, self.peak_occ
        for (name, alloc, cap), (s_used, s_live) in zip(self._pools, self._series):
            used = cap - alloc.available_size()
            ev = sizes.get(name)
            live = used - ev[0] if ev is not None else used
            s_used.append(used)
            s_live.append(live)
            if used > peak_occ[name]:
                peak_occ[name] = used
            if live > peak[name]:
                peak[name] = live

    # ------------------------------------------------------------ the end
    def final_pools(self) -> int:
        """Fill ``result.pools`` from the pools as they are now; returns the slots leaked over all of them."""
        sizes = self.cache.cached_sizes()
        leaked = 0
        out = []
        for name, alloc, cap in self._pools:
            avail = int(alloc.available_size())
            ev, prot = sizes.get(name, (0, 0))
            lost = cap - avail - ev - prot
            leaked += lost
            out.append({
                "name": name, "capacity": cap, "available": avail, "evictable": int(ev), "protected": int(prot),
                "leaked": lost, "peak": self.peak[name], "peak_occupied": self.peak_occ[name],
            })
        self.result.pools = out
        return leaked

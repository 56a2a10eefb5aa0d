"""Assemble the miss-ratio curves of a workload: LRU (exact at every size), the optimum, the ceiling."""

from __future__ import annotations

import gc
import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvcore.bench.spec import Workload
from kvcore.mrc.belady import optimal_hits
from kvcore.mrc.paths import workload_paths
from kvcore.mrc.stack import Reuse, stack_pass

__all__ = ["MissRatioCurve", "compute_mrc", "lru_hits", "size_grid"]


def lru_hits(reuse: Reuse, sizes: np.ndarray) -> np.ndarray:
    """Tokens an LRU prefix cache of each size reuses: every reused segment contributes the part of it
    that lies within the top ``C`` tokens of the stack."""
    sizes = np.asarray(sizes, dtype=np.int64)
    out = np.zeros(sizes.shape, dtype=np.int64)
    if reuse.w.size == 0:
        return out
    # Sorted by stack position, the contribution at C is a sum of full segments and one partial one.
    order = np.argsort(reuse.q, kind="stable")
    q, w = reuse.q[order], reuse.w[order]
    for k, c in enumerate(sizes.tolist()):
        out[k] = int(np.clip(c - q, 0, w).sum())
    return out


def size_grid(reuse: Reuse, page_size: int, points: int, extra: list[int] | None = None) -> np.ndarray:
    """``points`` sizes, log-spaced over 12 octaves up to the size where LRU reaches the ceiling,
    page-aligned, plus ``extra`` (e.g. the simulated sizes)."""
    ps = page_size
    if reuse.w.size:
        top = int((reuse.q + reuse.w).max())
        # Below about 1/4096 of that a cache holds less than one prompt of most workloads: nothing to see.
        low = max(ps, top >> 12)
    else:
        top = low = ps
    top = -(-top // ps) * ps
    low = min(-(-low // ps) * ps, top)
    if points < 2 or top == low:
        grid = [top]
    else:
        grid = [round(math.exp(x) / ps) * ps for x in np.linspace(math.log(low), math.log(top), points)]
    grid = [max(ps, g) for g in grid] + [int(e) for e in (extra or [])]
    return np.array(sorted(set(grid)), dtype=np.int64)


@dataclass
class MissRatioCurve:
    """Hit rates (token-weighted, as the bench's ``hit_rate``) at each size; ``*_tokens`` the reused tokens."""

    workload: str
    page_size: int
    requests: int
    prompt_tokens: int
    sizes: np.ndarray
    lru_tokens: np.ndarray
    optimal_tokens: np.ndarray
    infinite_tokens: int
    seconds: float
    simulated: list[dict[str, Any]] = field(default_factory=list)
    reuse: Reuse | None = field(default=None, repr=False)  # the stack pass, for the curve at other sizes

    def lru_at(self, sizes: list[int]) -> list[int]:
        """Reused tokens of the LRU curve at any ``sizes`` (0 at sizes below one page)."""
        if self.reuse is None:
            raise ValueError("this curve keeps no stack pass")
        return lru_hits(self.reuse, np.array([max(0, s) for s in sizes], dtype=np.int64)).tolist()

    def rate(self, tokens: np.ndarray | int) -> Any:
        p = self.prompt_tokens
        return tokens / p if p else tokens * 0.0

    @property
    def lru(self) -> np.ndarray:
        return self.rate(self.lru_tokens)

    @property
    def optimal(self) -> np.ndarray:
        return self.rate(self.optimal_tokens)

    @property
    def infinite(self) -> float:
        return float(self.rate(self.infinite_tokens))

    def at(self, size: int) -> tuple[float, float]:
        """(LRU, optimal) hit rate at ``size``, one of :attr:`sizes`."""
        k = int(np.searchsorted(self.sizes, size))
        if k >= self.sizes.size or int(self.sizes[k]) != size:
            raise ValueError(f"size {size} is not on the curve's grid")
        return float(self.lru[k]), float(self.optimal[k])

    def to_json(self) -> dict[str, Any]:
        return {
            "workload": self.workload,
            "page_size": self.page_size,
            "sizes": self.sizes.tolist(),
            "lru": [float(x) for x in self.lru],
            "optimal": [float(x) for x in self.optimal],
            "infinite": self.infinite,
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": {"lru": self.lru_tokens.tolist(), "optimal": self.optimal_tokens.tolist(),
                              "infinite": self.infinite_tokens},
            "simulated": self.simulated,
            "seconds": round(self.seconds, 3),
        }


def compute_mrc(workload: Workload, page_size: int = 1, *, points: int = 40,
                extra_sizes: list[int] | None = None) -> MissRatioCurve:
    """The curves of ``workload`` (requests in :func:`kvcore.mrc.paths.serving_order`)."""
    if points < 1:
        raise ValueError(f"--points must be at least 1, got {points}")
    for s in extra_sizes or []:
        if s < page_size or s % page_size:
            raise ValueError(f"size {s} must be a positive multiple of the page size {page_size}")
    t0 = time.perf_counter()
    # The pass allocates a node per split and builds no cycles: the cyclic collector would only rescan the
    # growing tree (about a third of the time on the Mooncake conversation trace).
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        reuse = stack_pass(workload_paths(workload, page_size))
    finally:
        if was_enabled:
            gc.enable()
    sizes = size_grid(reuse, page_size, points, extra_sizes)
    lru = lru_hits(reuse, sizes)
    opt = optimal_hits(reuse, sizes)
    return MissRatioCurve(workload.name, page_size, reuse.requests, reuse.prompt_tokens, sizes, lru, opt,
                          int(reuse.w.sum()), time.perf_counter() - t0, reuse=reuse)

"""Belady's MIN for a prefix tree, at many cache sizes in one pass.

What "optimal" means here: the cache holds at most ``C`` tokens in whole pages between
requests; after each request it may keep any of the pages it held or the request just
used (an offline choice, with the whole future known: the choice is free, as a radix
tree that can evict any unlocked leaf at any time); a request reuses the longest cached
prefix of its prompt up to its match limit.  The optimum maximises reused tokens.

Relax the prefix rule: let a request reuse every cached page of its path, holes and
all.  With pages of one size this is caching with bypass, where keeping the pages whose
next use comes soonest (Belady's MIN) is optimal; equivalently a page is worth keeping
over the interval from one use to its next counted use, and choosing the most such
intervals with at most ``C`` pages held at any time is done by the greedy that takes
intervals by their end, each as far as room allows (Yannakakis and Gavril).  A parent is
used whenever its child is, so its interval lies inside the child's and ends no later;
taken first (a path from the root down), it is kept whenever the child is: the greedy's
cache is prefix-closed, its holes-and-all reuse is prefix reuse, and the relaxed
optimum -- an upper bound on every prefix-closed cache of size ``C`` -- is reached.  So
the curve is the optimum, and no policy (LRU included) beats it at any size.

A segment of ``w`` tokens is ``w / page`` pages with the same interval, the parent-first
order keeping its first tokens first, so the greedy takes ``min(w, C - peak)`` tokens of
it, where ``peak`` is the most held at any time of its interval.  The hold profile for all
``K`` sizes is one ``(requests, K)`` array; each interval is one vectorised max and add
over its rows.
"""

from __future__ import annotations

import numpy as np

from kvcore.mrc.stack import Reuse

__all__ = ["optimal_hits"]


def optimal_hits(reuse: Reuse, sizes: np.ndarray) -> np.ndarray:
    """Tokens the optimal cache reuses at each of ``sizes`` (tokens, multiples of the page size)."""
    sizes = np.asarray(sizes, dtype=np.int64)
    hits = np.zeros(sizes.shape, dtype=np.int64)
    if reuse.w.size == 0:
        return hits
    held = np.zeros((reuse.requests, sizes.size), dtype=np.int64)
    zero = np.zeros(sizes.size, dtype=np.int64)
    for s, r, w in zip(reuse.s.tolist(), reuse.r.tolist(), reuse.w.tolist()):
        rows = held[s:r]  # the states after requests s .. r-1: the page is kept in all of them
        room = sizes - rows.max(axis=0)
        take = np.minimum(np.maximum(room, zero), w)
        rows += take
        hits += take
    return hits

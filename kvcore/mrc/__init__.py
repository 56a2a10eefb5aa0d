"""``kvcore mrc``: miss-ratio curves of a workload -- LRU at every cache size, the offline optimum, the ceiling.

:func:`compute_mrc` runs one pass over the workload's request paths
(:mod:`kvcore.mrc.stack`), then evaluates the LRU curve and Belady's optimum
(:mod:`kvcore.mrc.belady`) at a grid of sizes.  See docs/bench.md, "Miss-ratio curves".
"""

from __future__ import annotations

from kvcore.mrc.curve import MissRatioCurve, compute_mrc

__all__ = ["MissRatioCurve", "compute_mrc"]

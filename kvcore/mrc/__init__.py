"""``kvcore mrc``: miss-ratio curves of a workload -- LRU at every cache size, the offline optimum, the ceiling.

:func:`compute_mrc` runs one pass over the workload's request paths
(:mod:`kvcore.mrc.stack`), then evaluates the LRU curve and Belady's optimum
(:mod:`kvcore.mrc.belady`) at a grid of sizes.  See docs/bench.md, "Miss-ratio curves".
Import cost stays low (the CLI imports this package): numpy and the workloads load on use.
"""

from __future__ import annotations

from typing import Any

__all__ = ["MissRatioCurve", "compute_mrc"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from kvcore.mrc import curve

        return getattr(curve, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

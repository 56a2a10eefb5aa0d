"""One accumulating timer for the loop's sections (``with stopwatch: ...``)."""

from __future__ import annotations

from time import perf_counter

__all__ = ["Stopwatch"]


class Stopwatch:
    """Adds the time spent inside each ``with`` block to ``seconds``; blocks must not nest."""

    __slots__ = ("seconds", "_t0")

    def __init__(self) -> None:
        self.seconds = 0.0
        self._t0 = 0.0

    def __enter__(self) -> Stopwatch:
        self._t0 = perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds += perf_counter() - self._t0

"""Argument checks every cache's public entry points share: refuse before changing anything."""

from __future__ import annotations

import operator
from typing import Any

__all__ = ["check_evict_count", "check_request_ids", "request_ids"]


def check_evict_count(value: Any, what: str = "num_tokens") -> int:
    """``value`` as a non-negative int: TypeError for a non-int (bools too), ValueError when negative."""
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an int, got bool ({value!r})")
    try:
        n = operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an int, got {type(value).__name__} ({value!r})") from None
    if n < 0:
        raise ValueError(f"{what} must be >= 0, got {n}")
    return n


def check_request_ids(req: Any, n: int, have: int | None = None) -> None:
    """ValueError naming the request when it holds fewer than ``n`` token ids (its ``kv_committed_len``);
    ``have``: how many it holds (default ``req.seqlen``, so ``fill_ids`` need not be built).  Call it
    before anything changes."""
    if have is None:
        have = req.seqlen
    if have < n:
        raise ValueError(f"request {req.rid!r} has {have} tokens but kv_committed_len={n}")


def request_ids(req: Any, n: int) -> list[int]:
    """The first ``n`` token ids of ``req`` (``fill_ids[:n]``), the key its cached KV goes under.

    ValueError naming the request when it holds fewer than ``n`` ids (nothing changed).
    """
    ids = req.fill_ids
    check_request_ids(req, n, len(ids))
    return ids[:n]

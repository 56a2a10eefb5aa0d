"""The bench's side of the tiers: ``--host-size``, ``--store`` and ``--host-write-policy``.

One run with tiers flushes the store writes at the end of every step (never on
the match path) and reports device, host and store hits separately, the bytes
moved and the store's counters (JSON ``store``; the ``host`` pool is in
``pools`` like any other).  ``--instances K`` (K engines on one shared store) is
:mod:`kvcore.bench.instances`.
"""

from __future__ import annotations

import time
from typing import Any

from kvcore.tiers import TieredCacheMixin

__all__ = ["STORE_KEYS", "BenchTiers", "check_tier_options", "report_fields", "tier_options"]

#: The store counters a report carries (JSON ``store``).
STORE_KEYS = ("hits", "misses", "errors", "bytes_read", "bytes_written", "round_trips")


def check_tier_options(host_size: int, store: str | None, instances: int, page_size: int,
                       host_write_policy: str = "write_through") -> None:
    """Refuse bad ``--host-size`` / ``--store`` / ``--instances`` before anything runs (ValueError, one line);
    the backend's config checks ``--host-write-policy``'s name, here only that it has a tier to write to."""
    if host_size < 0 or host_size % page_size:
        raise ValueError(f"--host-size {host_size} must be a non-negative multiple of --page-size {page_size}")
    if host_write_policy != "write_through" and not (host_size or store):
        raise ValueError(f"--host-write-policy {host_write_policy} needs a tier to write to: "
                         "give --host-size or --store")
    if instances < 1:
        raise ValueError(f"--instances must be at least 1, got {instances}")
    if store is not None:
        from kvcore.stores.registry import StoreURL, available_stores

        url = StoreURL.parse(store)
        if url.scheme not in available_stores():
            known = ", ".join(s + "://" for s in available_stores())
            raise ValueError(f"--store {store!r}: no store for scheme {url.scheme + '://'!r}; known: {known}")
        if instances > 1 and url.scheme == "memory":
            raise ValueError("--instances runs separate processes: a memory:// store is private to one; "
                             "use file:///dir or redis://host:port/0")


def tier_options(backend: str, fields: set[str], host_size: int, store: str | None,
                 host_write_policy: str = "write_through") -> dict[str, Any]:
    """The create_cache options for the tiers; a backend without them is refused, naming it."""
    opts: dict[str, Any] = {}
    if host_size:
        opts["host_size"] = host_size
    if store is not None:
        opts["store"] = store
    if opts and host_write_policy != "write_through":
        opts["host_write_policy"] = host_write_policy
    if opts and not {"host_size", "store"} <= fields:
        raise ValueError(f"backend {backend!r} takes no host tier or store (--host-size, --store); radix and "
                         "unified do")
    return opts


class BenchTiers:
    """Flushes a tiered cache's store writes after each step and collects its counters at the end."""

    def __init__(self, cache: TieredCacheMixin) -> None:
        self.cache = cache
        self.flush_s = 0.0

    @classmethod
    def attach(cls, cache: Any) -> BenchTiers | None:
        return cls(cache) if isinstance(cache, TieredCacheMixin) else None

    def after_step(self) -> None:
        t = time.perf_counter()
        self.cache.flush()
        self.flush_s += time.perf_counter() - t

    def finish(self) -> dict[str, Any]:
        self.after_step()
        stats = self.cache.tier_stats()
        stats["store_flush_s"] = self.flush_s
        return stats


def report_fields(tiers: dict[str, Any], cached_tokens: int) -> dict[str, Any]:
    """JSON ``store`` (the store's counters) and ``tiers`` (hits by tier, bytes moved) of one run."""
    if not tiers:
        return {}
    host = int(tiers.get("host_hit_tokens", 0))
    store_hits = int(tiers.get("store_hit_tokens", 0))
    out: dict[str, Any] = {"tiers": {
        "device_hit_tokens": cached_tokens - host - store_hits,
        "host_hit_tokens": host,
        "store_hit_tokens": store_hits,
        "bytes_to_device": int(tiers.get("bytes_host_to_device", 0)),
        "bytes_from_device": int(tiers.get("bytes_device_to_host", 0)),
        "store_written_pages": int(tiers.get("store_written_pages", 0)),
        "store_failed_pages": int(tiers.get("store_failed_pages", 0)),
        "written_back_pages": int(tiers.get("written_back_pages", 0)),
        "store_flush_s": float(tiers.get("store_flush_s", 0.0)),
    }}
    if "store" in tiers:
        out["store"] = {k: int(tiers["store"].get(k, 0)) for k in STORE_KEYS}
    return out

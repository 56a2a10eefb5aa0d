"""Options of the Redis stores, from the URL's query (``?timeout=0.5&ttl=600``)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["RedisOptions"]


class RedisOptions(BaseModel):
    """``timeout``: seconds one round trip (and a connect) may take before it is a miss; ``ttl``: seconds a
    value lives (Redis expires it; with ``maxmemory`` and a ``volatile-*`` or ``allkeys-*`` policy a full
    server evicts instead of refusing writes); ``backoff``: seconds a server (a cluster node) that just
    failed is skipped, answering misses at once, so a dead or stalled server costs one ``timeout`` per
    ``backoff`` rather than one per call."""

    model_config = ConfigDict(extra="forbid")

    timeout: float = Field(0.5, gt=0, le=60, description="seconds per round trip before it is a miss")
    ttl: float | None = Field(None, gt=0, description="seconds a value lives (SET PX)")
    backoff: float = Field(1.0, ge=0, le=600, description="seconds a failed server is skipped")

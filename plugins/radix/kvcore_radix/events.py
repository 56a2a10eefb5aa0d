"""KV placement events of the radix cache (one per page), for KV-aware routers."""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass
from typing import Optional, Sequence

__all__ = ["PageStored", "PageRemoved", "AllPagesCleared", "page_hash", "chain_page_hashes"]


@dataclass(frozen=True, slots=True)
class PageStored:
    """A page of KV entered the cache.  ``parent_hash`` is the previous page's hash (None at the root)."""

    page_hash: str
    parent_hash: Optional[str]
    token_ids: tuple
    extra_key: Optional[str] = None
    kind: str = "stored"


@dataclass(frozen=True, slots=True)
class PageRemoved:
    """A page of KV left the cache (evicted)."""

    page_hash: str
    kind: str = "removed"


@dataclass(frozen=True, slots=True)
class AllPagesCleared:
    """The cache was reset."""

    kind: str = "cleared"


def page_hash(tokens: Sequence[int], parent_hash: Optional[str], extra_key: Optional[str]) -> str:
    """SHA-256 hex digest of one page, chained on the previous page and namespaced by ``extra_key``.

    Deterministic across processes (no Python ``hash``): the same token prefix in
    the same namespace always yields the same chain.
    """
    h = hashlib.sha256()
    if parent_hash is not None:
        h.update(bytes.fromhex(parent_hash))
    if extra_key is not None:
        ek = str(extra_key).encode("utf-8")
        h.update(b"X" + len(ek).to_bytes(4, "little") + ek)
    h.update(array("q", tokens).tobytes())
    return h.hexdigest()


def chain_page_hashes(
    tokens: Sequence[int], page_size: int, parent_hash: Optional[str], extra_key: Optional[str]
) -> list[str]:
    """Hashes of consecutive pages of ``tokens``, each chained on the one before."""
    out: list[str] = []
    prev = parent_hash
    for start in range(0, len(tokens), page_size):
        prev = page_hash(tokens[start : start + page_size], prev, extra_key)
        out.append(prev)
    return out

"""KV placement events of tree caches (one per page), for KV-aware routers.

A tree cache with ``enable_kv_events`` appends these to a list and hands them out
through ``take_events()``: a :class:`PageStored` for every page that enters the
tree, a :class:`PageRemoved` for every page that leaves it, an
:class:`AllPagesCleared` on ``reset()``.  Page hashes are chained: each page's
hash covers the previous page's hash, the ``extra_key`` namespace and the page's
token ids, so equal hashes mean equal prefixes in the same namespace, in any
process.  :func:`record_stored` / :func:`record_removed` do the bookkeeping for
a :class:`kvcore.tree.Node` (its ``hash_value`` holds one hash per page).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "PageStored",
    "PageRemoved",
    "AllPagesCleared",
    "page_hash",
    "chain_page_hashes",
    "record_stored",
    "record_removed",
    "KVEventLog",
]


@dataclass(frozen=True, slots=True)
class PageStored:
    """A page of KV entered the cache.  ``parent_hash`` is the previous page's hash (None at the root)."""

    page_hash: str
    parent_hash: str | None
    token_ids: tuple
    extra_key: str | None = None
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


KVEvent = PageStored | PageRemoved | AllPagesCleared


def page_hash(tokens: Sequence[int], parent_hash: str | None, extra_key: str | None) -> str:
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
    tokens: Sequence[int], page_size: int, parent_hash: str | None, extra_key: str | None
) -> list[str]:
    """Hashes of consecutive pages of ``tokens``, each chained on the one before."""
    out: list[str] = []
    prev = parent_hash
    for start in range(0, len(tokens), page_size):
        prev = page_hash(tokens[start : start + page_size], prev, extra_key)
        out.append(prev)
    return out


# ``node`` is a node of any tree backend (they share no base class): these read its
# ``parent``, ``key`` and ``extra_key`` and write its ``hash_value``.
def record_stored(events: list[KVEvent], node: Any, page_size: int) -> None:
    """Hash ``node``'s pages (chained on its parent's last page) into ``node.hash_value``
    and append one :class:`PageStored` per page to ``events``."""
    parent = node.parent
    parent_hash = parent.hash_value[-1] if parent is not None and parent.hash_value else None
    key = node.key
    extra_key = node.extra_key
    hashes = chain_page_hashes(key, page_size, parent_hash, extra_key)
    node.hash_value = hashes
    prev = parent_hash
    for i, h in enumerate(hashes):
        events.append(PageStored(h, prev, tuple(key[i * page_size : (i + 1) * page_size]), extra_key))
        prev = h


def record_removed(events: list[KVEvent], node: Any) -> None:
    """Append one :class:`PageRemoved` per hashed page of ``node`` to ``events``."""
    hashes = node.hash_value
    if hashes:
        events.extend(PageRemoved(h) for h in hashes)


class KVEventLog:
    """The KV-event log of a tree cache: a mixin listed before ``BasePrefixCache`` in its bases.

    The cache sets ``enable_kv_events`` and ``_events = []`` in its ``__init__``,
    appends with :func:`record_stored` / :func:`record_removed` while events are
    on, and calls :meth:`record_cleared` at the end of ``reset()``.
    """

    enable_kv_events: bool
    _events: list[KVEvent]

    def take_events(self) -> list[KVEvent]:
        """The events recorded since the last call, oldest first; the log starts empty again."""
        events, self._events = self._events, []
        return events

    def record_cleared(self) -> None:
        """A reset emptied the tree: one :class:`AllPagesCleared` (when events are on)."""
        if self.enable_kv_events:
            self._events.append(AllPagesCleared())

"""Eviction policies of tree backends (SGLang's ``evict_policy`` semantics).

A policy is any object with ``get_priority(node)``; the evictable leaf with the
smallest priority goes first.  The built-in ones read ``last_access_time``,
``creation_time``, ``hit_count`` and ``priority`` from the node, so a backend
that offers every policy gives its nodes those four fields.  Plugins add
policies through the ``kvcore_register_eviction_policies`` hook;
:func:`resolve_policy` builds one by name from that registry.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = [
    "EvictionStrategy",
    "LRUStrategy",
    "LFUStrategy",
    "FIFOStrategy",
    "MRUStrategy",
    "FILOStrategy",
    "PriorityStrategy",
    "SLRUStrategy",
    "BUILTIN_POLICIES",
    "resolve_policy",
]


class EvictionStrategy:
    """Base class; subclasses return a sortable priority, smallest evicted first.

    ``newest_first``: among equal priorities evict the newest node first (policies
    ordering by negated time, where SGLang's finer clock would rank the newer node lower).

    ``monotone``: a node's priority never decreases while it stays in the tree (given
    a clock that never goes back), so a tree may keep its evictable leaves in a heap
    and re-key an entry only when it surfaces (:class:`kvcore.tree.EvictOrder`).
    False (the default, and what a plugin policy gets unless it says otherwise): the
    tree ranks every evictable leaf afresh on each eviction, correct for any policy.
    A policy that says True and is not monotone evicts in the wrong order.
    """

    newest_first = False
    monotone = False

    def get_priority(self, node: Any) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError


class LRUStrategy(EvictionStrategy):
    """Least recently used first."""

    monotone = True  # access times only grow

    def get_priority(self, node: Any) -> float:
        return node.last_access_time


class LFUStrategy(EvictionStrategy):
    """Least frequently hit first, then least recently used."""

    monotone = True  # hit counts and access times only grow

    def get_priority(self, node: Any) -> tuple[int, float]:
        return (node.hit_count, node.last_access_time)


class FIFOStrategy(EvictionStrategy):
    """Oldest node first."""

    monotone = True  # a creation time never changes

    def get_priority(self, node: Any) -> float:
        return node.creation_time


class MRUStrategy(EvictionStrategy):
    """Most recently used first."""

    newest_first = True
    monotone = False  # a touch lowers the priority (-last_access_time): re-ranked each eviction

    def get_priority(self, node: Any) -> float:
        return -node.last_access_time


class FILOStrategy(EvictionStrategy):
    """Newest node first."""

    newest_first = True
    monotone = True  # a creation time never changes

    def get_priority(self, node: Any) -> float:
        return -node.creation_time


class PriorityStrategy(EvictionStrategy):
    """Lowest request priority first, then least recently used."""

    monotone = True  # a node's priority is only raised, access times only grow

    def get_priority(self, node: Any) -> tuple[int, float]:
        return (node.priority, node.last_access_time)


class SLRUStrategy(EvictionStrategy):
    """Segmented LRU: nodes hit fewer than ``protected_threshold`` times go first."""

    monotone = True  # a hit count only grows (a node only moves up a segment), access times only grow

    def __init__(self, protected_threshold: int = 2) -> None:
        self.protected_threshold = protected_threshold

    def get_priority(self, node: Any) -> tuple[int, float]:
        return (1 if node.hit_count >= self.protected_threshold else 0, node.last_access_time)


BUILTIN_POLICIES: dict[str, Callable[[], EvictionStrategy]] = {
    "lru": LRUStrategy,
    "lfu": LFUStrategy,
    "fifo": FIFOStrategy,
    "mru": MRUStrategy,
    "filo": FILOStrategy,
    "priority": PriorityStrategy,
    "slru": SLRUStrategy,
}


def resolve_policy(name: str) -> EvictionStrategy:
    """Build policy ``name`` from kvcore's registry (so plugins can add policies).

    Falls back to the built-in table when the registry does not know the name
    (e.g. plugin autoload disabled).  An unknown name raises ValueError listing
    every known policy.
    """
    if not isinstance(name, str):
        raise TypeError(f"eviction_policy must be a string, got {type(name).__name__}")
    key = name.lower()
    from kvcore.plugins import available_eviction_policies, get_eviction_policy

    known: set[str] = set(BUILTIN_POLICIES)
    try:
        factory = get_eviction_policy(key)
    except (LookupError, ValueError):
        factory = None
    known.update(available_eviction_policies())
    if factory is None:
        factory = BUILTIN_POLICIES.get(key)
    if factory is None:
        raise ValueError(f"unknown eviction policy {name!r}; known policies: {', '.join(sorted(known))}")
    policy = factory()
    if not callable(getattr(policy, "get_priority", None)):
        raise TypeError(f"eviction policy {name!r}: {policy!r} has no get_priority(node)")
    return policy

"""The evictable leaves of a tree, kept in eviction order (a set with a lazy heap behind it).

A tree used to rebuild a heap of every evictable leaf on each ``evict`` call, as
SGLang does: O(n) per call however few leaves go.  :class:`EvictOrder` is that set
of leaves kept as it changes, so a call costs O(victims * log n).

Each leaf has one live heap entry ``(priority, tie * id, node)``, the key the
per-call heap used (``tie`` is -1 for policies that evict the newest among equal
priorities); ids are unique, so the keys are totally ordered and the pop order is
the per-call heap's.  An entry is live while the ``node -> entry`` dict holds that
very entry.  ``discard`` (a leaf locked, or given a child) parks the entry: it stays
in the heap, and an ``add`` of the node (unlocked again) revives it instead of
pushing a new one; a parked entry that surfaces is dropped, and when parked entries
outnumber live ones the heap is rebuilt from the live ones.  ``add`` of a new node
pushes at once, so that one eviction never pays for the leaves added since the last
(a new leaf under a time-ordered policy is the newest: its push stays at the bottom).

The keys are not updated when a match touches a node (no hook on the request
path).  That is exact for a *monotone* policy (:attr:`EvictionStrategy.monotone`:
a node's priority never decreases while it is in the tree): every stored key is at
most its node's current key, so when the smallest entry's stored key is still its
node's current key, that node is the smallest of all; when it is not, the entry is
pushed again with the current key and the pop goes on (a lazy re-key).  For any
other policy (``mru``; a plugin policy unless it says ``monotone = True``)
:meth:`EvictOrder.refresh` rebuilds the heap from the current keys, which the tree
calls at the start of each eviction: today's per-call heap, correct for any policy.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator
from typing import Any

from kvcore.tree.policies import EvictionStrategy

__all__ = ["EvictOrder"]

# Parked heap entries tolerated before a rebuild: this many, and more than there are live ones.
_MIN_PARKED = 64


class EvictOrder:
    """A set of evictable nodes that pops them in ``policy``'s eviction order.

    Set-like (``add``, ``discard``, ``difference_update``, ``in``, ``len``,
    iteration in the order nodes were added) plus :meth:`pop` (the next victim,
    taken out of the set) and :meth:`refresh` (call once before the pops of one
    eviction).  ``policy`` is any object with ``get_priority(node)``; an
    :class:`EvictionStrategy` also gives ``newest_first`` (the tie order) and
    ``monotone`` (whether stored keys may be re-keyed lazily).
    """

    __slots__ = ("_entries", "_parked", "_heap", "_priority", "_tie", "monotone")

    def __init__(self, policy: Any) -> None:
        strategy = policy if isinstance(policy, EvictionStrategy) else None
        self._priority = policy.get_priority
        self._tie = -1 if strategy is not None and strategy.newest_first else 1
        self.monotone = strategy is not None and strategy.monotone
        self._entries: dict[Any, tuple] = {}  # node -> its live heap entry
        self._parked: dict[Any, tuple] = {}  # node out of the set -> its entry still in the heap
        self._heap: list[tuple] = []  # the entries of both

    # ------------------------------------------------------------------ the set

    def __contains__(self, node: Any) -> bool:
        return node in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._entries)

    @property
    def heap_size(self) -> int:
        """Heap entries held, live or parked: at most ``2 * len(self) + 64`` after any ``discard``."""
        return len(self._heap)

    def __repr__(self) -> str:
        return f"<EvictOrder {len(self._entries)} nodes, {len(self._parked)} parked>"

    def add(self, node: Any) -> None:
        entries = self._entries
        if node in entries:
            return
        entry = self._parked.pop(node, None)
        if entry is None:
            # A new leaf is the newest: under a time-ordered policy the push stays at the bottom (one comparison).
            entry = (self._priority(node), self._tie * node.id, node)
            heapq.heappush(self._heap, entry)
        # (A revived entry's key may be older than the node's: re-keyed when it surfaces, see pop.)
        entries[node] = entry

    def discard(self, node: Any) -> None:
        entry = self._entries.pop(node, None)
        if entry is not None:
            parked = self._parked
            parked[node] = entry
            if len(parked) > _MIN_PARKED and len(parked) > len(self._entries):
                self._rebuild()

    def difference_update(self, nodes: Iterable[Any]) -> None:
        for node in nodes:
            self.discard(node)

    def clear(self) -> None:
        self._entries.clear()
        self._parked.clear()
        self._heap.clear()

    # ------------------------------------------------------------------ eviction

    def refresh(self) -> None:
        """Start an eviction: a non-monotone policy's heap is rebuilt from the current keys."""
        if not self.monotone and self._entries:
            self._rebuild()

    def pop(self) -> Any | None:
        """Take the next victim (smallest ``(priority, tie * id)``) out of the set; None when empty."""
        heap, entries, priority = self._heap, self._entries, self._priority
        heappop = heapq.heappop
        while heap:
            entry = heappop(heap)
            node = entry[2]
            if entries.get(node) is not entry:
                del self._parked[node]  # out of the set: a later add pushes it anew
                continue
            key = priority(node)
            if key != entry[0]:
                # Touched since it was pushed (a monotone key only grows): back in at its current key.
                entry = (key, entry[1], node)
                entries[node] = entry
                heapq.heappush(heap, entry)
                continue
            del entries[node]
            return node
        return None

    def _rebuild(self) -> None:
        """One entry per node of the set, at its current key; nothing parked."""
        priority, tie = self._priority, self._tie
        heap = [(priority(node), tie * node.id, node) for node in self._entries]
        self._entries = {entry[2]: entry for entry in heap}
        heapq.heapify(heap)
        self._heap = heap
        self._parked = {}

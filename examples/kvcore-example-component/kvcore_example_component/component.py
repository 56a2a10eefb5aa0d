"""The ``stamp`` tree component: a stamp on each node where an insert ended; a match may end only there.

A stamp marks a request boundary: the end of a prompt or of a prefill chunk, where a
model that keeps per-request side state (a checkpoint, a summary) would have saved it.
It holds no pool slots; it is one unit of the component's own budget (``stamp_limit``
stamps) and counts the matches that ended on it (``stamp_hits``).  A split leaves the
stamp on the lower half, so the upper half is a tombstone a match may pass but not end
on.  A lock covers the node itself.  The stamps are kept in their own LRU order (a
match or an insert ending on one makes it the most recent); its eviction takes the
least recently used unlocked stamp: a leaf goes whole, an internal node keeps its full
slots (priority 0: nothing cascades from it).  At the limit, a new stamp first evicts one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from kvcore.cache import LockResult
from kvcore.tree.value_component import LRUValueComponent

if TYPE_CHECKING:
    from kvcore.tree.unified import InsertArgs, UnifiedNode, UnifiedRadixCache

__all__ = ["StampComponent", "StampOptions"]


class StampOptions(BaseModel):
    """Options of the ``stamp`` component."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    stamp_limit: int = Field(4096, gt=0, description="at most this many stamped nodes (the oldest unlocked one goes)")


class StampComponent(LRUValueComponent):
    """A stamp per request boundary: matches end only on stamps, single-node locks, LRU eviction of stamps."""

    name = "stamp"
    pool = "stamp"
    internal_priority = 0
    options = StampOptions
    lru_label = "stamp LRU"
    # stamp_value: the insert's sequence number (None: a tombstone); stamp_hits: matches that ended here.
    node_fields = {"stamp_value": None, "stamp_hits": 0, "stamp_lock_ref": 0, "stamp_prev": None, "stamp_next": None}
    cache: UnifiedRadixCache

    def __init__(self, cache: Any, options: BaseModel | None) -> None:
        super().__init__(cache, options)
        opts = options if isinstance(options, StampOptions) else StampOptions.model_validate({})
        self.limit = opts.stamp_limit
        self.stamps_made = 0
        self.hits = 0

    # -- per node ----------------------------------------------------------------------
    def has_value(self, node: UnifiedNode) -> bool:
        return node.stamp_value is not None

    def value_len(self, node: UnifiedNode) -> int:
        return 0 if node.stamp_value is None else 1

    def lock_ref(self, node: UnifiedNode) -> int:
        return node.stamp_lock_ref

    def free_value(self, node: UnifiedNode) -> int:
        node.stamp_hits = 0
        return self.forget_value(node)  # no pool slots to give back: only the books

    # on_split: nothing to do; the upper half is a new node, born a tombstone (node_fields).

    # -- match: the default validator (has_value) ends a match on stamped nodes only ----
    def after_match(self, node: UnifiedNode) -> None:
        if node.stamp_value is not None:
            node.stamp_hits += 1
            self.hits += 1
            self.lru.touch(node)

    # -- insert ------------------------------------------------------------------------
    def on_insert_commit(self, node: UnifiedNode, is_new_leaf: bool, ins: InsertArgs) -> None:
        if node is self.cache.root_node:
            return
        if node.stamp_value is not None:
            self.lru.touch(node)
            return
        if self.lru.count >= self.limit:
            # Make room: the least recently used unlocked stamp goes (``node`` holds none, so it is safe).
            self.evict(self.lru.count - self.limit + 1, {c.name: 0 for c in self.cache.components})
            if self.lru.count >= self.limit:
                return  # every stamp is locked: this boundary stays unstamped
        self.stamps_made += 1
        node.stamp_value = self.stamps_made
        self.lru.add_mru(node)
        self._evictable += 1

    # -- locks -------------------------------------------------------------------------
    def lock(self, node: UnifiedNode, lock: LockResult) -> None:
        if node.stamp_value is None:
            return  # nothing to hold; a stamp added later is not this lock's (unlock reads lock.extras)
        if node.stamp_lock_ref == 0:
            self._evictable -= 1
            self._protected += 1
        node.stamp_lock_ref += 1
        lock.extras["stamp"] = node.id

    def unlock(self, node: UnifiedNode, lock: LockResult | None) -> None:
        if lock is not None and lock.extras.get("stamp") != node.id:
            return
        if node.stamp_lock_ref > 0:
            node.stamp_lock_ref -= 1
            if node.stamp_lock_ref == 0:
                self._evictable += 1
                self._protected -= 1

    # -- checks ------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        return {"stamp_hits": self.hits}

    def check(self, node: UnifiedNode) -> None:
        if node.stamp_value is None:
            assert node not in self.lru and node.stamp_lock_ref == 0 and node.stamp_hits == 0, node
        else:
            assert node in self.lru, node

    def check_totals(self, root: UnifiedNode) -> None:
        from kvcore.tree import iter_subtree

        stamped = [x for x in iter_subtree(root) if x.stamp_value is not None]
        locked = sum(1 for x in stamped if x.stamp_lock_ref)
        assert (len(stamped) - locked, locked) == (self._evictable, self._protected), (len(stamped), locked)
        assert len(stamped) == self.lru.count <= self.limit, (len(stamped), self.lru.count, self.limit)

"""The ``full`` tree component (SGLang's FullComponent), which every component set starts with.

It decides which nodes exist: every node holds full-attention slots.  See
:mod:`kvcore.components` for the contract every component follows.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from kvcore.cache import LockResult, SlotOwner
from kvcore.components import TreeComponent
from kvcore.tree.node import iter_subtree, lock_path, unlock_path

if TYPE_CHECKING:
    from kvcore.tree.unified import UnifiedNode, UnifiedRadixCache

__all__ = ["FullComponent"]


class FullComponent(TreeComponent):
    """Full-attention KV slots on every node: path locks, unlocked leaves evicted by recency."""

    name = "full"
    pool = "full"
    internal_priority = 2
    cache: UnifiedRadixCache

    def reset_state(self) -> None:
        self._evictable = 0
        self._protected = 0

    def has_value(self, node: Any) -> bool:
        return node.value is not None

    def value_len(self, node: Any) -> int:
        return len(node.key)

    def lock_ref(self, node: Any) -> int:
        return node.lock_ref

    def added(self, node: UnifiedNode) -> None:
        self._evictable += len(node.key)

    def owned_slots(self, node: Any) -> Iterator[SlotOwner]:
        yield SlotOwner("full", f"{self.cache.node_label} {node.id} ({len(node.key)} tokens)", node.value)

    def free_value(self, node: Any) -> int:
        cache = self.cache
        alloc = cache.token_to_kv_pool_allocator
        if cache.strict:
            alloc.disown(node.value)
        if cache.free_batch is not None:
            # Freed when the eviction ends (after the tree reports them: ``evicting``), in eviction order.
            cache.free_batch.append(node.value)
        else:
            alloc.free(node.value)
        n = len(node.key)
        if node.lock_ref:
            self._protected -= n
        else:
            self._evictable -= n
        return n

    def lock(self, node: Any, lock: LockResult) -> None:
        root = self.cache.root_node
        leaves = self.cache.leaves
        delta = 0
        x = node
        while x is not root:
            if x.lock_ref == 0:
                delta += len(x.key)
                leaves.discard(x)
            x.lock_ref += 1
            x = x.parent
        self._evictable -= delta
        self._protected += delta
        lock.delta = delta

    def lock_path(self, path: list, newly: list) -> int:
        """A full-only tree's lock: ``path`` (leaf first) locked, as ``lock`` does."""
        delta = lock_path(path, newly)
        if newly:
            self.cache.leaves.difference_update(newly)
        self._evictable -= delta
        self._protected += delta
        return delta

    def unlock_path(self, path: list) -> int:
        """A full-only tree's unlock: as ``unlock``; the nodes whose last lock went may become leaves."""
        newly: list = []
        delta = unlock_path(path, newly)
        leaves = self.cache.leaves
        for x in newly:
            if not x.children:
                leaves.add(x)
        self._evictable += delta
        self._protected -= delta
        return delta

    def unlock(self, node: Any, lock: LockResult | None) -> None:
        cache = self.cache
        root = cache.root_node
        delta = 0
        x = node
        while x is not root:
            if x.lock_ref == 1:
                delta += len(x.key)
            x.lock_ref -= 1
            if x.lock_ref == 0:
                cache.update_leaf(x)
            x = x.parent
        self._evictable += delta
        self._protected -= delta

    def evict(self, target: int, tracker: dict[str, int]) -> None:
        cache = self.cache
        leaves = cache.leaves  # an EvictOrder by recency: a parent left childless is a candidate at once
        leaves.refresh()
        while tracker["full"] < target:
            x = leaves.pop()
            if x is None:
                return
            cache.delete_leaf(x, tracker)

    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def check_totals(self, root: Any) -> None:
        ev = pr = 0
        for x in iter_subtree(root):
            if x.lock_ref:
                pr += len(x.key)
            else:
                ev += len(x.key)
        assert (ev, pr) == (self._evictable, self._protected), ((ev, pr), (self._evictable, self._protected))

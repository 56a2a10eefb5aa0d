"""The base of components whose values may be tombstoned, each in its own LRU order (swa, mamba, yours)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvcore.components import TreeComponent
from kvcore.tree.lru import LRUList

if TYPE_CHECKING:
    import torch

    from kvcore.tree.unified import UnifiedNode

__all__ = ["LRUValueComponent"]


class LRUValueComponent(TreeComponent):
    """A component whose values may be tombstoned, kept in its own LRU list (swa, mamba).

    Its node fields are ``<name>_prev`` / ``<name>_next`` / ``<name>_lock_ref``; ``lru_label``
    names the list in errors.  Eviction walks that list from its least recently used
    unlocked end: a leaf goes whole, an internal node loses this component's value only.
    """

    lru_label = "LRU"

    def reset_state(self) -> None:
        from kvcore.tree.unified import UnifiedNode

        lock_field = f"{self.name}_lock_ref"

        def sentinel() -> UnifiedNode:
            n = UnifiedNode()
            setattr(n, lock_field, 0)  # a component field, set on every node
            return n

        self.lru = LRUList(sentinel, f"{self.name}_prev", f"{self.name}_next", lock_field, self.lru_label)
        self._evictable = 0
        self._protected = 0

    def requeue_split(self, upper: Any, child: Any) -> None:
        """Place a split node's parts in this component's LRU by the tree's ``split_recency``.

        ``child`` (the lower part) is in the list; ``upper`` joins it when the split gave it a value.
        SGLang 0.5.19: both go to the front, ``child`` first.  SGLang 0.5.23 (``keep``): ``child``
        stays where it was and ``upper`` goes right behind it.
        """
        lru = self.lru
        joins = getattr(upper, f"{self.name}_value") is not None
        if self.cache.split_keeps_recency:
            if joins:
                lru.add_behind(child, upper)
            return
        lru.remove(child)
        if joins:
            lru.add_mru(upper)
        lru.add_mru(child)

    def set_value(self, node: Any, value: torch.Tensor) -> None:
        """Give ``node`` this component's value (unlocked, most recently used)."""
        setattr(node, f"{self.name}_value", value)
        self.lru.add_mru(node)
        self._evictable += len(value)

    def forget_value(self, node: Any) -> int:
        """Tombstone ``node`` in this component's books (the caller gave its slots back); returns the units."""
        n = self.value_len(node)
        if self.lock_ref(node):
            self._protected -= n
        else:
            self._evictable -= n
        setattr(node, f"{self.name}_value", None)
        if node in self.lru:
            self.lru.remove(node)
        return n

    def evict(self, target: int, tracker: dict[str, int]) -> None:
        cache = self.cache
        lru = self.lru
        leaves = cache.leaves
        key = self.pool
        cursor = lru.lru_unlocked()
        while True:
            if cursor is not None and cursor not in lru:
                cursor = lru.lru_unlocked()
            if tracker[key] >= target or cursor is None:
                return
            x = cursor
            cursor = lru.prev_unlocked(x)
            if x in leaves:
                cache.delete_leaf(x, tracker)
            else:
                cache.drop_value(x, self, tracker)

    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

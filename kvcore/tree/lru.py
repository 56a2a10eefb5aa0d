"""LRU order lists: intrusive doubly linked lists of tree nodes.

A node carries its own links (two slots per list it can be in), so moving a
node to the front, removing it, or finding the least recently used unlocked
leaf costs no allocation and no search.  One node class can be in several
lists (SGLang's SWA tree keeps a full and a window order) by giving each list
its own pair of link slots and its own lock field.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["LRUList"]


class LRUList:
    """Nodes in use order, most recently used at the head.

    ``prev`` / ``next``: the names of the link slots this list uses on a node;
    ``lock``: the lock-count field that makes a node unevictable for this list;
    ``make_sentinel``: builds the head and tail sentinels (the node class).
    A node is in the list exactly when its ``prev`` link is not None.
    """

    def __init__(self, make_sentinel: Callable[[], Any], prev: str = "prev", next: str = "next",
                 lock: str = "lock_ref", name: str = "LRU") -> None:
        self.prv, self.nxt, self.lock, self.name = prev, next, lock, name
        self.head = make_sentinel()
        self.tail = make_sentinel()
        setattr(self.head, prev, None)
        setattr(self.head, next, self.tail)
        setattr(self.tail, prev, self.head)
        setattr(self.tail, next, None)
        self.count = 0

    def __len__(self) -> int:
        return self.count

    def __contains__(self, node: Any) -> bool:
        return node is not None and getattr(node, self.prv) is not None

    def _link_after(self, anchor: Any, node: Any) -> None:
        prv, nxt = self.prv, self.nxt
        after = getattr(anchor, nxt)
        setattr(node, prv, anchor)
        setattr(node, nxt, after)
        setattr(after, prv, node)
        setattr(anchor, nxt, node)

    def _unlink(self, node: Any) -> None:
        prv, nxt = self.prv, self.nxt
        p, n = getattr(node, prv), getattr(node, nxt)
        setattr(p, nxt, n)
        setattr(n, prv, p)
        setattr(node, prv, None)
        setattr(node, nxt, None)

    def add_mru(self, node: Any) -> None:
        """Insert ``node`` (not in the list) as the most recently used."""
        assert node not in self, f"{node} is already in the {self.name}"
        self._link_after(self.head, node)
        self.count += 1

    def add_behind(self, anchor: Any, node: Any) -> None:
        """Insert ``node`` (not in the list) right behind ``anchor`` (in it): the next less recently used."""
        assert node not in self, f"{node} is already in the {self.name}"
        assert anchor in self, f"{anchor} is not in the {self.name}"
        self._link_after(anchor, node)
        self.count += 1

    def remove(self, node: Any) -> None:
        assert node in self, f"{node} is not in the {self.name}"
        self._unlink(node)
        self.count -= 1

    def touch(self, node: Any) -> None:
        """Make ``node`` (in the list) the most recently used."""
        self._unlink(node)
        self._link_after(self.head, node)

    def touch_path(self, node: Any, root: Any, limit_tokens: int | None = None) -> None:
        """Make ``node`` and its ancestors below ``root`` most recent, each child more recent than its parent.

        Nodes of the path that are not in the list are skipped.  With ``limit_tokens``
        only the deepest part of the path is touched: a node is touched while the
        tokens of the nodes below it on the path (skipped ones included) are fewer
        than ``limit_tokens`` (SGLang's "the last W + page tokens" recency update).
        """
        anchor = self.head
        prv = self.prv
        if limit_tokens is None:
            while node is not root:
                if getattr(node, prv) is not None:
                    self._unlink(node)
                    self._link_after(anchor, node)
                    anchor = node
                node = node.parent
            return
        acc = 0
        while node is not root and acc < limit_tokens:
            if getattr(node, prv) is not None:
                self._unlink(node)
                self._link_after(anchor, node)
                anchor = node
            acc += len(node.key)
            node = node.parent

    def lru_unlocked(self, leaf_only: bool = False) -> Any | None:
        """The least recently used node without a lock (and, if asked, without children)."""
        return self.prev_unlocked(self.tail, leaf_only)

    def prev_unlocked(self, node: Any, leaf_only: bool = False) -> Any | None:
        """The next more recently used node than ``node`` without a lock (and, if asked, without children)."""
        prv, lock, head = self.prv, self.lock, self.head
        x = getattr(node, prv)
        while x is not head and (getattr(x, lock) > 0 or (leaf_only and x.children)):
            x = getattr(x, prv)
        return None if x is head else x

    def __iter__(self) -> Iterator[Any]:
        """From least to most recently used."""
        prv, head = self.prv, self.head
        x = getattr(self.tail, prv)
        while x is not head:
            yield x
            x = getattr(x, prv)

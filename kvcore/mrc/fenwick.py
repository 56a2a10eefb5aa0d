"""A Fenwick (binary indexed) tree of token weights over access stamps: O(log n) add and prefix sum."""

from __future__ import annotations

__all__ = ["Fenwick"]


class Fenwick:
    """Weights at stamps ``0 .. size-1``; ``above(i)`` is the weight at stamps greater than ``i``."""

    __slots__ = ("tree", "size", "total")

    def __init__(self, size: int):
        self.size = size
        self.tree = [0] * (size + 1)
        self.total = 0

    def add(self, i: int, delta: int) -> None:
        tree, n = self.tree, self.size
        self.total += delta
        i += 1
        while i <= n:
            tree[i] += delta
            i += i & -i

    def grow(self, size: int) -> None:
        """Room for stamps up to ``size - 1``, weights kept (O(n), rare)."""
        if size <= self.size:
            return
        old, n = self.tree, self.size
        vals = [0] * (size + 1)
        # Point values back from the old tree: v[i] = prefix(i) - prefix(i - 1).
        running = [0] * (n + 1)
        for i in range(1, n + 1):
            running[i] = old[i] + (running[i - (i & -i)])
        for i in range(1, n + 1):
            vals[i] = running[i] - running[i - 1]
        tree = vals
        for i in range(1, size + 1):
            j = i + (i & -i)
            if j <= size:
                tree[j] += tree[i]
        self.tree, self.size = tree, size

    def prefix(self, i: int) -> int:
        """Weight at stamps ``0 .. i``."""
        tree = self.tree
        s = 0
        i += 1
        while i > 0:
            s += tree[i]
            i -= i & -i
        return s

    def above(self, i: int) -> int:
        return self.total - self.prefix(i)

"""Tree nodes: the base class, the split that carries every per-node state, path and lock walks.

A node is one edge of a compressed radix tree: ``key`` (token ids, a list) and
``value`` (their KV slots, a 1-D int64 tensor of the same length).  ``children``
maps a child's first page (see :func:`kvcore.tree.child_key`) to the child;
``ck`` is the key under which the node itself sits in ``parent.children``.  A
node taken out of the tree has ``parent = None``.

Backends subclass :class:`Node`, add their own ``__slots__`` and say which of
them a split copies (``split_copy``) or moves to the upper half
(``split_move``).  Their ``__init__`` may set every slot itself rather than call
``Node.__init__`` (one call fewer on the insert path).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

__all__ = [
    "Node",
    "next_node_id",
    "split_node",
    "path_to_root",
    "check_locked",
    "lock_path",
    "unlock_path",
    "iter_subtree",
    "tree_lines",
]

N = TypeVar("N", bound="Node")

#: A process-wide increasing node id: creation order, and a stable tie-breaker.
next_node_id = itertools.count(1).__next__


class Node:
    """Base of tree nodes.

    Fields: ``children``, ``parent``, ``key``, ``value``, ``ck``, ``extra_key``
    (the namespace of the whole path), ``id`` (from :data:`next_node_id`),
    ``lock_ref`` (requests holding this node), ``last_access_time``,
    ``hit_count`` and ``hash_value`` (one KV-event hash per page, or None).
    """

    __slots__ = (
        "children",
        "parent",
        "key",
        "value",
        "ck",
        "extra_key",
        "id",
        "lock_ref",
        "last_access_time",
        "hit_count",
        "hash_value",
    )

    children: dict[Any, Any]
    parent: Any  # the parent node, None at the root and once taken out of the tree
    key: list[int]
    value: Any  # a 1-D int64 tensor of slots
    ck: Any
    extra_key: Any
    id: int
    lock_ref: int
    last_access_time: float
    hit_count: int
    hash_value: list[str] | None

    #: Per-node fields :func:`split_node` copies from a node to its new upper half.
    split_copy: tuple[str, ...] = ("lock_ref", "last_access_time", "hit_count")
    #: Fields the upper half takes over (the lower half is left with None), such as
    #: a marker of where a lock stopped: after a split it belongs at the top.
    split_move: tuple[str, ...] = ()

    def __init__(self, key: list[int] | None = None, value: Any = None, parent: Node | None = None,
                 ck: Any = None, extra_key: Any = None) -> None:
        self.children = {}
        self.parent = parent
        self.key = [] if key is None else key
        self.value = value
        self.ck = ck
        self.extra_key = extra_key
        self.id = next_node_id()
        self.lock_ref = 0
        self.last_access_time = 0
        self.hit_count = 0
        self.hash_value = None

    def __lt__(self, other: Node) -> bool:
        return self.id < other.id

    def __repr__(self) -> str:
        ids = self.key if len(self.key) <= 6 else f"{self.key[:6]}...+{len(self.key) - 6}"
        return f"<{type(self).__name__} {self.id} len={len(self.key)} lock_ref={self.lock_ref} key={ids}>"


def split_node(child: Node, k: int, upper: N, page_size: int = 1) -> N:
    """Cut ``child`` after ``k`` tokens; ``upper`` (a fresh node the caller made) becomes the upper half.

    ``upper`` takes ``child``'s place under its parent (same ``ck``, same dict
    position), the first ``k`` tokens and slots (views, not copies), the
    namespace, the first ``k // page_size`` page hashes and every field named in
    ``type(child).split_copy`` and ``split_move``; ``child`` keeps the rest and
    hangs under ``upper``.  Fields of ``upper`` not named there keep the values
    its constructor gave them (a creation time of "now", a new id).  Returns ``upper``.
    """
    parent = child.parent
    key = child.key
    value = child.value
    upper.parent = parent
    upper.key = key[:k]
    upper.value = value[:k]
    upper.ck = ck = child.ck
    upper.extra_key = child.extra_key
    cls = type(child)
    for name in cls.split_copy:
        setattr(upper, name, getattr(child, name))
    for name in cls.split_move:
        setattr(upper, name, getattr(child, name))
        setattr(child, name, None)
    rest = key[k:]
    child.key = rest
    child.value = value[k:]
    child.ck = rest[0] if page_size == 1 else tuple(rest[:page_size])
    child.parent = upper
    upper.children = {child.ck: child}
    parent.children[ck] = upper
    hashes = child.hash_value
    if hashes is not None:
        pages = k // page_size
        upper.hash_value, child.hash_value = hashes[:pages], hashes[pages:]
    return upper


def path_to_root(node: Any, root: Node, what: str = "lock") -> list[Any]:
    """``node`` and its ancestors below ``root``, leaf first.

    Raises ValueError (naming ``what``) when ``node`` is not in the tree under
    ``root``: taken out (evicted), or from another cache.
    """
    path: list[Any] = []
    x = node
    while x is not root:
        if x is None:
            raise ValueError(f"{what}: {node!r} is not in this cache's tree (evicted, or from another cache)")
        path.append(x)
        x = x.parent
    return path


def check_locked(path: list[Any], node: Any, what: str = "dec_lock_ref") -> None:
    """Raise ValueError unless every node of ``path`` holds a lock (before anything changes)."""
    for x in path:
        if x.lock_ref <= 0:
            raise ValueError(
                f"{what}: {x!r} on the path of {node!r} is not locked; was this lock already released?"
            )


def lock_path(path: list[Any], newly_locked: list[Any] | None = None) -> int:
    """Add one lock to every node of ``path``; returns the tokens that became protected.

    Nodes that were unlocked are appended to ``newly_locked`` when given (a
    backend drops them from its evictable set).
    """
    delta = 0
    for x in path:
        if x.lock_ref == 0:
            delta += len(x.key)
            if newly_locked is not None:
                newly_locked.append(x)
        x.lock_ref += 1
    return delta


def unlock_path(path: list[Any], newly_unlocked: list[Any] | None = None) -> int:
    """Take one lock off every node of ``path`` (call :func:`check_locked` first).

    Returns the tokens that became evictable; the nodes whose last lock went are
    appended to ``newly_unlocked`` when given.
    """
    delta = 0
    for x in path:
        x.lock_ref -= 1
        if x.lock_ref == 0:
            delta += len(x.key)
            if newly_unlocked is not None:
                newly_unlocked.append(x)
    return delta


def iter_subtree(node: Node) -> Iterator[Any]:
    """Every node below ``node`` (not ``node`` itself), depth first."""
    stack = list(node.children.values())
    while stack:
        x = stack.pop()
        yield x
        stack.extend(x.children.values())


def tree_lines(root: Node, describe: Callable[[Any], str] = repr) -> list[str]:
    """One line per node below ``root``, depth first in ``children`` order, indented two spaces a level."""
    lines: list[str] = []
    stack = [(child, 0) for child in reversed(list(root.children.values()))]
    while stack:
        x, depth = stack.pop()
        lines.append("  " * depth + describe(x))
        stack.extend((child, depth + 1) for child in reversed(list(x.children.values())))
    return lines

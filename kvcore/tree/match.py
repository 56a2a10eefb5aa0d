"""Walking a key down a tree: child keys by first page, and the prefix-length search.

Keys are plain Python lists of token ids.  Comparisons are C-level list-slice
comparisons (``ids[a:b] == key[c:d]``): one slice compare of a whole edge is the
fast path, and :func:`prefix_match_len` finds a mismatch point with a handful
of them, so the cost of a walk follows the number of branch points, not the
number of tokens.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

from kvcore.keys import check_token_ids

__all__ = ["child_key", "descend", "edge_match_len", "prefix_match_len"]


def child_key(ids: Sequence[int], pos: int = 0, page_size: int = 1, extra_key: Any = None) -> Hashable:
    """The dict key under which the edge starting at ``ids[pos]`` sits in its parent's ``children``.

    The first token with ``page_size == 1``, else the first page as a tuple: two
    edges under one node never share their first page, so the page names the
    edge.  Keys of another namespace (``extra_key`` not None) sit under
    ``(extra_key, page)``: only the root's children need it, since every node
    below shares its root child's namespace.  Hot loops inline this expression.
    """
    page = ids[pos] if page_size == 1 else tuple(ids[pos : pos + page_size])
    return page if extra_key is None else (extra_key, page)


def prefix_match_len(ids: Sequence[int], pos: int, key: Sequence[int], n: int, page_size: int = 1) -> int:
    """How many leading tokens of ``key[:n]`` equal ``ids[pos:pos + n]``, floored to whole pages.

    Doubling windows (16, 32, 64, ... tokens) find the window holding the first
    difference, then bisection narrows it; every step is one slice comparison.
    The answer never exceeds ``n``, ``len(key)`` or ``len(ids) - pos``.  A caller
    that expects whole-edge matches tries ``ids[pos:pos + len(key)] == key``
    first (one comparison) and calls this on a miss.
    """
    a, off, b = ids, pos, key
    if n > len(b):
        n = len(b)
    if n > len(a) - off:
        n = len(a) - off
    lo, step = 0, 16
    while lo < n:
        hi = lo + step if lo + step < n else n
        if a[off + lo : off + hi] != b[lo:hi]:
            while hi - lo > 1:
                mid = (lo + hi) >> 1
                if a[off + lo : off + mid] == b[lo:mid]:
                    lo = mid
                else:
                    hi = mid
            return lo - lo % page_size if page_size > 1 else lo
        lo = hi
        step <<= 1
    if n <= 0:
        return 0
    return n - n % page_size if page_size > 1 else n


def edge_match_len(ids: list[int], pos: int, key: list[int], n: int, page_size: int = 1) -> int:
    """How many tokens of the edge ``key`` match ``ids[pos:n]``: ``len(key)`` when the whole edge does.

    One slice comparison when the whole edge matches, :func:`prefix_match_len`
    (floored to whole pages, never ``len(key)``) otherwise: a result below
    ``len(key)`` means the walk ends inside this edge (split it there).
    """
    plen = len(key)
    if pos + plen <= n and ids[pos : pos + plen] == key:
        return plen
    return prefix_match_len(ids, pos, key, min(plen, n - pos), page_size)


def descend(root: Any, ids: list[int], n: int, page_size: int = 1,
            extra_key: Any = None) -> tuple[list[Any], int, Any, int]:
    """The read-only walk of ``ids[:n]`` (``n`` page-aligned) from ``root``; changes nothing.

    Returns ``(path, pos, child, m)``: the nodes whose whole edge matched (root
    excluded, root first) and the tokens they cover, then the node a match ends
    inside (None when it ends on a node boundary) and how many of its tokens
    matched (whole pages, at least one: its first page named it).  A tree that
    must split there calls :func:`kvcore.tree.split_node` on ``child`` after ``m``
    tokens.  An unhashable element of ``ids`` is reported by
    :func:`kvcore.keys.check_token_ids` (TypeError naming it) before anything else.
    """
    path: list[Any] = []
    if n <= 0:
        return path, 0, None, 0
    ps = page_size
    pos = 0
    ck: Any = ids[0] if ps == 1 else tuple(ids[:ps])
    if extra_key is not None:
        ck = (extra_key, ck)
    children = root.children
    try:
        while True:
            child = children.get(ck)
            if child is None:
                return path, pos, None, 0
            ckey = child.key
            end = pos + len(ckey)
            if end <= n and ids[pos:end] == ckey:
                path.append(child)
                pos = end
                if pos >= n:
                    return path, pos, None, 0
                children = child.children
                ck = ids[pos] if ps == 1 else tuple(ids[pos : pos + ps])
                continue
            return path, pos, child, prefix_match_len(ids, pos, ckey, min(len(ckey), n - pos), ps)
    except TypeError:  # an unhashable element: report it the canonical way
        check_token_ids(ids)
        raise

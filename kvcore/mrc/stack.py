"""One pass over the request paths: the LRU stack position and the reuse interval of every reused segment.

The prefix tree here never evicts: it is Mattson's stack.  A node is a run of symbols
(:mod:`kvcore.mrc.paths`) whose tokens were all last touched by the same request; a
request that touches part of a node splits it, as a radix tree splits an edge, so
every node touched is touched whole.  Recency is one Fenwick tree of token weights
over access stamps: a request gives its path fresh stamps deepest first, so a parent
is always more recent than its child, and under LRU the tokens cached at any size
form a prefix-closed set (the top of the stack) -- what a radix tree under LRU holds.

For every segment a request reuses within its match limit (the limit is also a node
boundary), the pass records

- ``q``: tokens more recent than the segment just before the request (its stack
  position is ``q + 1 .. q + w``): an LRU cache of ``C`` tokens holds
  ``clip(C - q, 0, w)`` of its ``w`` tokens, and since positions grow along a path
  the sum over the path is the request's hit at size ``C``;
- ``s``: the request that last touched it, the start of its reuse interval, for
  :mod:`kvcore.mrc.belady`.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass

import numpy as np

from kvcore.mrc.fenwick import Fenwick
from kvcore.mrc.paths import Path

__all__ = ["Reuse", "stack_pass"]


class _Node:
    __slots__ = ("ids", "his", "lo", "weight", "children", "stamp", "last")

    def __init__(self, ids: list[Hashable], his: list[int], lo: int):
        self.ids = ids
        self.his = his
        self.lo = lo  # first token of the first symbol (a node continuing a block split inside it)
        self.weight = sum(his) - lo
        self.children: dict[tuple[Hashable, int], _Node] = {}
        self.stamp = -1  # -1: created by the request now walking (not yet seen)
        self.last = -1


def _split(node: _Node, j: int, m: int) -> _Node:
    """Cut ``node`` at symbol ``j``, token ``m`` of it; returns the new upper part (it takes the node's place).

    The upper part keeps the node's stamp and last request (the caller fixes the
    Fenwick weights once the request's stack positions are read).
    """
    lo_j = node.lo if j == 0 else 0
    if m > lo_j:  # inside symbol j: the upper part ends with its first tokens
        up = _Node(node.ids[: j + 1], node.his[:j] + [m], node.lo)
        node.ids = node.ids[j:]
        node.his = node.his[j:]
        node.lo = m
    else:  # at the boundary before symbol j
        up = _Node(node.ids[:j], node.his[:j], node.lo)
        node.ids = node.ids[j:]
        node.his = node.his[j:]
        node.lo = 0
    node.weight -= up.weight
    up.stamp, up.last = node.stamp, node.last
    up.children[(node.ids[0], node.lo)] = node
    return up


def _cut_at(node: _Node, tokens: int) -> tuple[int, int]:
    """The (symbol, token) position ``tokens`` tokens into ``node``."""
    acc = 0
    lo = node.lo
    for j, hi in enumerate(node.his):
        w = hi - lo
        if acc + w > tokens:
            return j, lo + (tokens - acc)
        acc += w
        lo = 0
    raise AssertionError("cut past the node's end")


@dataclass
class Reuse:
    """The stack pass's output: one row per reused segment within a match limit, in processing order
    (requests in serving order, each path from the root down)."""

    requests: int
    prompt_tokens: int
    q: np.ndarray  # tokens more recent than the segment
    w: np.ndarray  # the segment's tokens
    s: np.ndarray  # request (serving index) that touched it last
    r: np.ndarray  # request reusing it


def stack_pass(paths: Iterable[Path]) -> Reuse:
    root = _Node([], [], 0)
    plist = list(paths)
    # A request stamps about one segment per symbol, one more for the limit cut (the tree grows if not).
    fen = Fenwick(sum(min(len(p.ids), 32) + 2 for p in plist) + 1)
    stamp = 0
    rq: list[int] = []
    rw: list[int] = []
    rs: list[int] = []
    rr: list[int] = []
    prompt_tokens = 0
    for r, path in enumerate(plist):
        prompt_tokens += path.prompt_len
        segs, counted = _walk(root, path)
        # Stack positions before anything moves: split parts share a stamp, the upper part first.
        prev_stamp, prev_q, prev_w = -2, 0, 0
        for k in range(counted):
            node = segs[k]
            if node.stamp < 0:
                break
            q = prev_q + prev_w if node.stamp == prev_stamp else fen.above(node.stamp)
            rq.append(q)
            rw.append(node.weight)
            rs.append(node.last)
            rr.append(r)
            prev_stamp, prev_q, prev_w = node.stamp, q, node.weight
        if stamp + len(segs) > fen.size:
            fen.grow(2 * (stamp + len(segs)))
        for node in reversed(segs):  # deepest first: a parent ends up more recent than its child
            if node.stamp >= 0:
                fen.add(node.stamp, -node.weight)
            fen.add(stamp, node.weight)
            node.stamp = stamp
            node.last = r
            stamp += 1
    return Reuse(len(plist), prompt_tokens, np.array(rq, dtype=np.int64), np.array(rw, dtype=np.int64),
                 np.array(rs, dtype=np.int64), np.array(rr, dtype=np.int64))


def _walk(root: _Node, path: Path) -> tuple[list[_Node], int]:
    """Insert ``path``, splitting nodes so that its end and its limit are node boundaries; returns the
    nodes along it, root first, and how many of them lie within the limit."""
    ids, his, limit = path.ids, path.his, path.limit
    n = len(ids)
    segs: list[_Node] = []
    node = root
    i = off = 0  # next symbol of the path, tokens of it already walked
    pos = 0  # tokens of the path walked
    counted = -1
    while i < n:
        key = (ids[i], off)
        child = node.children.get(key)
        if child is None:
            child = _Node(ids[i:], his[i:], off)
            node.children[key] = child
            matched, whole = child.weight, True
        else:
            matched, whole = _follow(child, ids, his, i)
        if pos < limit < pos + matched:
            child = node.children[key] = _split(child, *_cut_at(child, limit - pos))
            counted = len(segs) + 1
        elif not whole:
            child = node.children[key] = _split(child, *_cut_at(child, matched))
        segs.append(child)
        pos += child.weight
        i, off = _advance(his, i, off, child.weight)
        node = child
    if counted < 0:
        counted = len(segs) if pos <= limit else _count_within(segs, limit)
    return segs, counted


def _advance(his: list[int], i: int, off: int, t: int) -> tuple[int, int]:
    """The path position ``t`` tokens after (symbol i, token off)."""
    while t:
        rem = his[i] - off
        if t < rem:
            return i, off + t
        t -= rem
        i += 1
        off = 0
    return i, off


def _follow(child: _Node, ids: list, his: list[int], i: int) -> tuple[int, bool]:
    """Tokens of ``child`` the path follows from symbol ``i`` (the key lookup matched the child's first
    symbol and its start), and whether that is all of it."""
    cids, chis, lo = child.ids, child.his, child.lo
    L = len(cids)
    h0, p0 = chis[0], his[i]
    if h0 != p0:
        if p0 < h0:  # the path's (partial, last) symbol ends inside the child's
            return p0 - lo, False
        return h0 - lo, L == 1  # the child's block is partial: the path goes on inside the block
    if L == 1:
        return h0 - lo, True
    n = len(ids)
    if ids[i + 1 : i + L] == cids[1:] and his[i + 1 : i + L] == chis[1:]:
        return child.weight, True
    acc = h0 - lo
    for j in range(1, L):
        k = i + j
        if k >= n or ids[k] != cids[j]:
            return acc, False
        if his[k] != chis[j]:
            if his[k] < chis[j]:
                return acc + his[k], False
            return acc + chis[j], j == L - 1  # the child's block is partial: the path goes on inside it
        acc += chis[j]
    return acc, True


def _count_within(segs: list[_Node], limit: int) -> int:
    acc = 0
    for k, node in enumerate(segs):
        if acc + node.weight > limit:
            return k
        acc += node.weight
    return len(segs)

"""The hit rate an infinite cache would reach on the same request stream.

A compressed radix tree over plain lists that never evicts: each request matches
its prompt (at most ``len(prompt) - 1`` tokens, page-aligned, as the serving loop
does), then its whole sequence (prompt + output) is inserted.  Edge comparisons
are C-level slice comparisons (``kvcore.tree.prefix_match_len`` on a partial
edge), so the cost follows the number of branch points, not the number of tokens.
"""

from __future__ import annotations

from kvcore.tree import prefix_match_len

__all__ = ["InfiniteCache"]


class _Node:
    __slots__ = ("key", "children")

    def __init__(self, key: list[int]):
        self.key = key
        self.children: dict[int, _Node] = {}


def _common(ids: list[int], pos: int, key: list[int], n: int) -> int:
    """Length of the common prefix of ``ids[pos:pos+n]`` and ``key[:n]``: a whole edge in one comparison,
    else the tree kit's search."""
    if ids[pos : pos + n] == key[:n]:
        return n
    return prefix_match_len(ids, pos, key, n)


class InfiniteCache:
    def __init__(self, page_size: int = 1):
        self.page_size = page_size
        self.root = _Node([])

    def match(self, ids: list[int], limit: int) -> int:
        node, pos = self.root, 0
        while pos < limit:
            child = node.children.get(ids[pos])
            if child is None:
                break
            n = min(len(child.key), limit - pos)
            m = _common(ids, pos, child.key, n)
            pos += m
            if m < len(child.key):
                break
            node = child
        return pos - pos % self.page_size

    def insert(self, ids: list[int]) -> None:
        node, pos, total = self.root, 0, len(ids)
        while pos < total:
            child = node.children.get(ids[pos])
            if child is None:
                node.children[ids[pos]] = _Node(ids[pos:])
                return
            n = min(len(child.key), total - pos)
            m = _common(ids, pos, child.key, n)
            if m < len(child.key):
                # Split the edge at m: the upper part keeps the old key's head.
                lower = _Node(child.key[m:])
                lower.children = child.children
                child.key = child.key[:m]
                child.children = {lower.key[0]: lower}
            pos += m
            node = child


class BlockInfiniteCache:
    """The same never-evicting cache for streamed requests, kept as a trie of block ids.

    A streamed request's prompt is a chain of (block id, tokens) segments
    (:meth:`kvcore.bench.spec.TokenRecipe.prompt_blocks`) followed by fresh tokens; equal
    ids on equal paths hold equal tokens and fresh tokens match nothing, so the token
    radix tree reduces to one entry per distinct block path holding the most tokens of
    that block seen so far.  Memory follows distinct blocks (about 100 bytes per 512
    tokens), not tokens.  It agrees with :class:`InfiniteCache` on the same tokens except
    where two different blocks begin with the same random token (probability 1/31,999).
    """

    def __init__(self, page_size: int = 1):
        self.page_size = page_size
        self.nodes: dict[tuple[int, int], tuple[int, int]] = {}  # (parent node, id) -> (node, tokens seen)

    def match_and_insert(self, blocks: list[tuple[int, int]], limit: int) -> int:
        """Tokens of the prompt (at most ``limit``, page-aligned) already seen; then the prompt is inserted."""
        nodes = self.nodes
        parent = 0
        hit = 0
        matching = True
        for h, n in blocks:
            entry = nodes.get((parent, h))
            if entry is None:
                node, seen = len(nodes) + 1, 0
            else:
                node, seen = entry
            if matching:
                hit += min(seen, n)
                matching = seen >= n
            if n > seen:
                nodes[(parent, h)] = (node, n)
            parent = node
        hit = min(hit, limit)
        return hit - hit % self.page_size

"""``ExampleCache``: a small radix-tree prefix cache built on :mod:`kvcore.tree`.

It is the example of ``docs/writing-a-backend.md``: every method the protocol asks of a
backend, written plainly (no hot-path tricks), each keeping the invariants the guide
lists.  Evictable leaves are found by a walk; a real backend keeps them in a set.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator
from typing import Any, cast

import torch
from pydantic import Field

from kvcore import (
    BasePrefixCache,
    CacheInitParams,
    EvictResult,
    InsertResult,
    LockResult,
    MatchResult,
    Req,
    SlotOwner,
    TreeCacheConfig,
)
from kvcore.keys import KeyLike, RadixKey
from kvcore.pools.allocator import SlotClaims
from kvcore.record import floor_align
from kvcore.tree import (
    Node,
    ResumableInsert,
    check_evict_count,
    check_locked,
    check_token_ids,
    checked_key,
    checked_value,
    child_key,
    descend,
    iter_subtree,
    lock_path,
    path_to_root,
    path_values,
    resolve_policy,
    split_node,
    unlock_path,
)

__all__ = ["ExampleCache", "ExampleConfig", "ExampleNode"]


class ExampleConfig(TreeCacheConfig):
    """The tree options (``eviction_policy``, ``enable_kv_events``, ``disable``), the pool options, and one
    of the example's own (strict like every kvcore option: ``True`` or ``"64"`` is refused)."""

    min_prefix_tokens: int = Field(0, ge=0, description="reuse a cached prefix only when it is this long")


class ExampleNode(Node):
    """A tree edge: :class:`kvcore.tree.Node` plus what the eviction policies read."""

    __slots__ = ("creation_time", "priority")

    split_copy = ("lock_ref", "last_access_time", "hit_count", "creation_time", "priority")

    def __init__(self, key: list[int] | None = None, value: Any = None, parent: Node | None = None,
                 ck: Any = None, extra_key: Any = None, now: int = 0) -> None:
        super().__init__(key, value, parent, ck, extra_key)
        self.last_access_time = now
        self.creation_time = now
        self.priority = 0


class ExampleCache(ResumableInsert, BasePrefixCache[ExampleNode]):
    """A radix tree over kvcore's pools: page-aligned reuse, path locks, policy-ordered leaf eviction."""

    def __init__(self, params: CacheInitParams) -> None:
        config = params.config
        if not isinstance(config, ExampleConfig):
            raise TypeError(f"ExampleCache needs an ExampleConfig, got {type(config).__name__}")
        super().__init__(params)  # pools, page size, config, strict
        self.config = config
        self.disable = config.disable
        self.min_prefix_tokens = config.min_prefix_tokens
        self.policy = resolve_policy(config.eviction_policy)
        self.device = torch.device(self.token_to_kv_pool_allocator.device)
        # With strict on, the allocator records which slots the tree owns (kvcore's allocators do).
        self._claims = cast(SlotClaims, self.token_to_kv_pool_allocator)
        self._clock = itertools.count(1).__next__
        self._empty = torch.empty((0,), dtype=torch.int64, device=self.device)
        self._new_tree()

    def _new_tree(self) -> None:
        self.root_node = ExampleNode([], self._empty)
        self.root_node.lock_ref = 1  # the root is never evicted
        self._evictable = 0
        self._protected = 0

    # -- lookups and updates ------------------------------------------------------------

    def _walk(self, rk: RadixKey, n: int) -> tuple[list[ExampleNode], int]:
        """The nodes covering the longest cached prefix of ``rk``'s first ``n`` tokens (splitting an edge
        where the match ends inside it) and that prefix's length."""
        path, pos, child, m = descend(self.root_node, rk.token_ids, n, self.page_size, rk.extra_key)
        if child is not None:
            now = self._clock()
            path.append(split_node(child, m, ExampleNode(now=now), self.page_size))
            pos += m
        return path, pos

    def match_prefix(self, key: KeyLike) -> MatchResult:
        rk = checked_key(key)  # TypeError / ValueError on a bad key, before anything changes
        n = floor_align(len(rk), self.page_size)
        if self.disable or n == 0:
            return MatchResult(self._empty, self.root_node, self.root_node)
        path, pos = self._walk(rk, n)
        if not path or pos < self.min_prefix_tokens:
            return MatchResult(self._empty, self.root_node, self.root_node)
        now = self._clock()
        for x in path:
            x.last_access_time = now
        node = path[-1]
        return MatchResult(path_values(node, self.root_node, self._empty), node, node)

    def insert(self, key: KeyLike, value: torch.Tensor | None = None) -> InsertResult:
        """Insert the page-aligned part of ``key`` -> ``value``; returns how much of it was cached already.

        The slots of the already-cached part stay the caller's to free (``duplicates_freed`` False).
        """
        rk = checked_key(key)
        n = floor_align(len(rk), self.page_size)
        slots = checked_value(value, len(rk), n, self.device)  # TypeError / ValueError, nothing changed
        if self.disable or n == 0:
            return InsertResult(0, self.root_node)
        path, pos = self._walk(rk, n)
        return self._commit(path, rk.token_ids, pos, n, slots, rk.extra_key)

    def _commit(self, path: list[ExampleNode], ids: list[int], pos: int, n: int, slots: torch.Tensor,
                extra_key: Any, base: int = 0, row_checked: bool = False) -> InsertResult:
        """An insert once its walk is known: ``path`` (root side first) touched, then a leaf for ``ids[pos:n]``.

        ``base``: tokens in front of ``ids[0]`` (a resumed insert's ids start below its locked node);
        ``row_checked``: the slots were checked claimable already (a resumed insert checks the request's row).
        """
        node = path[-1] if path else self.root_node
        now = self._clock()
        for x in path:
            x.last_access_time = now
            x.hit_count += 1
        if pos < n:
            new = slots[pos:n].clone()
            if self.strict and row_checked:
                self._claims.claim(new, checked=False)
            elif self.strict:
                # Claim the slots the tree keeps: refused (nothing changed) when free, padding, out of range,
                # duplicated or another node's.
                self._claims.check_claimable(new, commit=True)
            ck = child_key(ids, pos, self.page_size, extra_key if node is self.root_node else None)
            leaf = ExampleNode(ids[pos:n], new, node, ck, extra_key, now)
            leaf.hit_count = 1
            node.children[ck] = leaf
            self._evictable += n - pos
            node = leaf
        return InsertResult(base + pos, node)

    # -- locks ----------------------------------------------------------------------------

    def _path(self, node: Any, what: str) -> list[ExampleNode]:
        if not isinstance(node, ExampleNode):
            raise TypeError(f"{what}: expected an ExampleNode of this cache, got {type(node).__name__}")
        return path_to_root(node, self.root_node, what)  # ValueError: evicted, or another cache's

    def inc_lock_ref(self, node: ExampleNode) -> LockResult:
        if self.disable:
            return LockResult(delta=0)
        return LockResult(delta=self._lock(self._path(node, "inc_lock_ref")))

    def _lock(self, path: list[ExampleNode]) -> int:
        delta = lock_path(path)
        self._evictable -= delta
        self._protected += delta
        return delta

    def dec_lock_ref(self, node: ExampleNode, lock: LockResult | None = None) -> LockResult:
        if self.disable:
            return LockResult(delta=0)
        path = self._path(node, "dec_lock_ref")
        check_locked(path, node, "dec_lock_ref")
        if lock is not None:
            lock.check_not_released("dec_lock_ref", node)  # the one rule: a lock goes back once
            lock.released = True
        delta = unlock_path(path)
        self._evictable += delta
        self._protected -= delta
        return LockResult(delta=-delta)

    # -- eviction -------------------------------------------------------------------------

    def evict(self, num_tokens: int) -> EvictResult:
        num_tokens = check_evict_count(num_tokens)  # TypeError / ValueError
        if num_tokens == 0:
            return EvictResult(0)
        get_priority = self.policy.get_priority
        heap = [(get_priority(x), x.id, x) for x in iter_subtree(self.root_node)
                if not x.children and x.lock_ref == 0]
        heapq.heapify(heap)
        freed: list[torch.Tensor] = []
        evicted = 0
        while evicted < num_tokens and heap:
            x = heapq.heappop(heap)[2]
            parent = x.parent
            del parent.children[x.ck]
            x.parent = None  # taken out of the tree: a later lock on it is refused
            freed.append(x.value)
            evicted += len(x.key)
            self._evictable -= len(x.key)
            if parent is not self.root_node and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (get_priority(parent), parent.id, parent))
        if freed:
            slots = torch.cat(freed)
            if self.strict:
                self._claims.disown(slots)
            self.token_to_kv_pool_allocator.free(slots)
        return EvictResult(num_tokens_evicted=evicted)

    # -- the request lifecycle ------------------------------------------------------------

    def check_node_locked(self, node: ExampleNode, what: str) -> None:
        # What the inherited check_req / check_req_lock ask of a tree: a node of ours, its path locked.
        check_locked(self._path(node, what), node, what)

    def _insert_row(self, req: Req, aligned: int) -> InsertResult:
        kv = req.kv
        values = self.req_to_token_pool.req_to_token[kv.req_pool_idx, :aligned].to(torch.int64)
        protected = kv.cache_protected_len
        if self.strict and aligned > protected:
            # The request's part of the row as a whole, before anything changes: the insert keeps some of it
            # and the caller frees the rest as duplicates, so neither may be refused after the tree changed.
            self._claims.check_claimable(values[protected:], what=f"request {req.rid!r}")
        return self.insert(RadixKey(req.fill_ids[:aligned], req.extra_key), values)

    def cache_finished_req(self, req: Req, is_insert: bool = True) -> None:
        self.check_req(req, "cache_finished_req")
        kv = req.kv
        committed, protected = kv.kv_committed_len, kv.cache_protected_len
        aligned = floor_align(committed, self.page_size)
        if self.disable or not is_insert:
            self.free_kv_row(kv, [(protected, committed)])
        elif self.resume_finished(req):
            return  # inserted from the request's locked node, the lock given back
        else:
            result = self._insert_row(req, aligned)
            # The tree kept [prefix_len, aligned): free the duplicates above what the request's lock already
            # covered, and the unaligned tail.  The over-allocation past committed is release_kv_cache's.
            self.free_kv_row(kv, [(protected, result.prefix_len), (aligned, committed)])
        self.release_req_lock(req)

    def cache_unfinished_req(self, req: Req, chunked: bool = False) -> None:
        if self.disable:
            return
        self.check_req(req, "cache_unfinished_req")
        # The next chunk from the request's locked node, when kvcore.tree.resume can prove it may.
        if self.resume_unfinished(req, chunked):
            return
        kv = req.kv
        committed, protected = kv.kv_committed_len, kv.cache_protected_len
        aligned = floor_align(committed, self.page_size)
        result = self._insert_row(req, aligned)
        self.free_kv_row(kv, [(protected, result.prefix_len)])
        # Point the request at the tree's copy of [0, aligned): row, lock, prefix_indices, protected length.
        match = self.match_prefix(RadixKey(req.fill_ids[:aligned], req.extra_key))
        if match.prefix_len < aligned:
            # min_prefix_tokens hides a short prefix from match_prefix: the insert above still holds it.
            node = result.last_device_node
            match = MatchResult(path_values(node, self.root_node, self._empty), node, node)
        self.rebase_on_match(req, match, committed)
        self.note_resume_point(req, match.device_indices)

    # -- the resumed insert's parts: what insert and match_prefix do to the nodes ---------

    def resume_insert(self, upper: list, ids: list[int], values: torch.Tensor, base: int, priority: int,
                      chunked: bool) -> tuple[int, Any, bool]:
        check_token_ids(ids)  # insert checks the whole key; the ids above are the tree's own
        path, pos, child, m = descend(upper[-1], ids, len(ids), self.page_size)
        if child is not None:
            path.append(split_node(child, m, ExampleNode(now=self._clock()), self.page_size))
            pos += m
        result = self._commit(upper + path, ids, pos, len(ids), values, upper[-1].extra_key, base, True)
        return result.prefix_len, result.last_device_node, False

    def resume_stamp(self, node: Any) -> None:
        path = path_to_root(node, self.root_node)
        if sum(len(x.key) for x in path) < self.min_prefix_tokens:
            return  # match_prefix hides a prefix this short and touches nothing
        now = self._clock()
        for x in path:
            x.last_access_time = now

    def resume_lock(self, nodes: list) -> int:
        return self._lock(nodes)

    # -- sizes, pools, checks ---------------------------------------------------------------

    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def iter_owned_slots(self) -> Iterator[SlotOwner]:
        for x in iter_subtree(self.root_node):
            yield SlotOwner("full", f"example node {x.id}", x.value)

    def reset(self) -> None:
        if self._protected:
            raise RuntimeError(f"reset() while {self._protected} cached tokens are locked; finish those requests")
        values = [x.value for x in iter_subtree(self.root_node)]
        if values:
            slots = torch.cat(values)
            if self.strict:
                self._claims.disown(slots)
            self.token_to_kv_pool_allocator.free(slots)
        self._new_tree()

    def sanity_check(self) -> None:
        evictable = protected = 0
        for x in iter_subtree(self.root_node):
            assert len(x.key) % self.page_size == 0, f"{x!r}: key is not whole pages"
            assert x.value.numel() == len(x.key), f"{x!r}: {x.value.numel()} slots for {len(x.key)} tokens"
            assert x.lock_ref >= 0, f"{x!r}: negative lock_ref"
            if x.lock_ref:
                protected += len(x.key)
            else:
                evictable += len(x.key)
        assert (evictable, protected) == (self._evictable, self._protected), (
            f"sizes ({self._evictable}, {self._protected}) but the tree holds ({evictable}, {protected})"
        )

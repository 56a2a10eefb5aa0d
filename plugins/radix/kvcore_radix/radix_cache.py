"""A radix-tree prefix cache over kvcore's pools (SGLang RadixCache semantics).

Hot-path notes: keys are plain Python lists and whole node keys are compared
with one C-level slice comparison (``ids[pos:end] == node.key``); only when that
fails is the mismatch point found by bisection over slice comparisons.  Node
values stay tensors (split halves are views, never re-copied) and ``match_prefix``
concatenates once at the end.  One clock reading per call, ``__slots__`` nodes.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Hashable, Iterator
from typing import TYPE_CHECKING, Any, cast

import torch

from kvcore.cache import BasePrefixCache, EvictResult, InsertResult, LockResult, MatchResult, SlotOwner
from kvcore.config import CacheInitParams
from kvcore.keys import KeyLike, RadixKey, as_radix_key, check_token_ids
from kvcore.pools.allocator import SlotClaims
from kvcore.record import floor_align
from kvcore.tree import (
    EvictOrder,
    KVEventLog,
    Node,
    ResumableInsert,
    check_evict_count,
    check_locked,
    descend,
    iter_subtree,
    lock_path,
    next_node_id,
    path_to_root,
    record_removed,
    record_stored,
    resolve_policy,
    split_node,
    unlock_path,
)
from kvcore_radix.config import RadixConfig

if TYPE_CHECKING:
    from kvcore.record import Req

__all__ = ["RadixCache", "RadixConfig", "TreeNode"]

_log = logging.getLogger(__name__)

_INT_DTYPES = frozenset({torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8})


class TreeNode(Node):
    """One edge of the radix tree: ``key`` (token ids) and ``value`` (their KV slots).

    ``ck`` is the key under which the node sits in ``parent.children``.  An
    evicted node has ``value`` and ``parent`` None.  On top of
    :class:`kvcore.tree.Node`: ``creation_time`` and ``priority`` (for the
    ``fifo``/``filo`` and ``priority`` policies).
    """

    __slots__ = ("creation_time", "priority")

    split_copy = ("lock_ref", "last_access_time", "hit_count", "priority")

    def __init__(self, key: list[int], value: torch.Tensor | None, parent: TreeNode | None, ck: Hashable,
                 now: float, priority: int = 0, extra_key: str | None = None) -> None:
        self.children: dict = {}
        self.parent = parent
        self.key = key
        self.value = value
        self.ck = ck
        self.extra_key = extra_key
        self.id = next_node_id()
        self.lock_ref = 0
        self.last_access_time = now
        self.creation_time = now
        self.hit_count = 0
        self.priority = priority
        self.hash_value = None

    @property
    def evicted(self) -> bool:
        return self.value is None

    def __repr__(self) -> str:
        ids = self.key if len(self.key) <= 6 else f"{self.key[:6]}...+{len(self.key) - 6}"
        return f"<radix node {self.id} len={len(self.key)} lock_ref={self.lock_ref} key={ids}>"


class RadixCache(KVEventLog, ResumableInsert, BasePrefixCache):
    """SGLang-style radix tree cache; the class is its own ``create_cache`` factory."""

    # Tests may replace the clock on an instance (e.g. an itertools counter).
    clock = staticmethod(time.monotonic)
    reports_evictions = True

    def __init__(self, params: CacheInitParams):
        super().__init__(params)
        config = cast(RadixConfig, params.config)
        self.config = config
        alloc = self.token_to_kv_pool_allocator
        # Tree-only (no allocator), as SGLang builds its RadixCache in its own unit tests: the values are the
        # caller's, so evict and reset only drop them, and the strict slot checks have no pool to check against.
        self.tree_only = alloc is None
        if alloc is not None and alloc.page_size != self.page_size:
            raise ValueError(f"page_size={self.page_size} differs from the allocator's page_size={alloc.page_size}")
        self.disable = bool(config.disable)
        # strict (set by the base): insert claims its slots in the allocator (refusing free, padding,
        # out-of-range, duplicated or already-owned ones) and evict/reset disown them.
        self.strict = self.strict and not self.tree_only
        if self.tree_only and config.strict:
            _log.info("radix: tree-only cache (no allocator): strict slot checks have nothing to check against")
        self._claims = cast(SlotClaims, self.token_to_kv_pool_allocator)
        self.enable_kv_events = bool(config.enable_kv_events)
        self.eviction_policy = str(config.eviction_policy).lower()
        # key_validation is radix's own option; a config of another backend built on this tree (npu) validates fully.
        self._check_match_tail = not (isinstance(config, RadixConfig) and config.key_validation == "stored")
        # Equal priorities go oldest node first, or newest first for policies that evict the
        # newest (mru, filo: the strategy's newest_first, which EvictOrder reads): SGLang's
        # clock orders a new leaf after its split sibling within one call, where ours reads it once.
        self.eviction_strategy = resolve_policy(self.eviction_policy)
        self.device = torch.device("cpu" if alloc is None else alloc.device)
        self._events: list = []
        self._init_tree()

    # ------------------------------------------------------------------ state

    def _init_tree(self) -> None:
        root = TreeNode([], torch.empty((0,), dtype=torch.int64, device=self.device), None, None, self.clock(),
                        priority=-sys.maxsize)
        root.lock_ref = 1
        # (key, length, path, matched length, rest free of 0/1) of the last match_prefix, for the insert after it.
        self._last_walk: tuple | None = None
        root.hash_value = []
        self.root_node = root
        self._evictable_size = 0
        self._protected_size = 0
        # The unlocked childless nodes, in eviction order (no scan of them per evict call).
        self._evictable_leaves = EvictOrder(self.eviction_strategy)
        self._empty_match = MatchResult(root.value, root, root)

    def reset(self) -> None:
        """Drop every cached entry and free its slots.  Refused while a node is locked."""
        if self._protected_size:
            raise RuntimeError(
                f"reset() while {self._protected_size} cached tokens are locked by running requests; "
                "finish them (or release their locks) first"
            )
        values = [] if self.tree_only else [owner.slots for owner in self.iter_owned_slots()]
        if values:
            slots = torch.cat(values)
            if self.strict:
                self._claims.disown(slots)
            self.token_to_kv_pool_allocator.free(slots)
        self._init_tree()
        self.record_cleared()

    def evictable_size(self) -> int:
        return self._evictable_size

    def protected_size(self) -> int:
        return self._protected_size

    def total_size(self) -> int:
        return sum(len(node.key) for node in iter_subtree(self.root_node))

    def pools(self) -> list:
        # A tree-only cache runs on no pool: the invariant checker has no slot to prove.
        return [] if self.tree_only else super().pools()

    def iter_owned_slots(self) -> Iterator[SlotOwner]:
        for node in iter_subtree(self.root_node):
            yield SlotOwner("full", f"radix node {node.id}", node.value)

    def format_tree(self) -> str:
        lines = []
        stack = [(self.root_node, 0)]
        while stack:
            node, indent = stack.pop()
            lines.append(" " * indent + f" [{node.id}] {len(node.key)} {node.key[:10]} r={node.lock_ref}")
            for child in node.children.values():
                stack.append((child, indent + 2))
        lines.append(f"#tokens: {self.total_size()}")
        return "\n".join(lines)

    # ------------------------------------------------------------------ lookups

    def _walk(self, rk: RadixKey, n: int, check_tail: bool = True) -> tuple:
        """:func:`kvcore.tree.descend` plus validation of every token the walk did not prove equal to a cached one.

        Cached keys hold only validated ids, so a token that compared equal to one
        is a valid id; the rest of the key is checked in one C pass before anything
        in the tree changes.  Returns ``descend``'s four values and whether that
        rest is known to hold no 0 or 1 (so that a key equal to this one holds no bool).
        """
        ids = rk.token_ids
        # (An unhashable element raises check_token_ids' TypeError naming it.)
        found = descend(self.root_node, ids, n, self.page_size, rk.extra_key)
        no01 = False
        if check_tail and not rk.validated:
            no01 = check_token_ids(ids, found[1] + found[3], refuse_bools=self.strict)
            # The walked part equals validated cached ids, the rest was just checked.
            rk.validated = True
        return found + (no01,)

    def _reuse_walk(self, rk: RadixKey, n: int) -> tuple | None:
        """The last ``match_prefix`` walk when ``rk`` holds the same first ``n`` ids (and namespace).

        An engine matches a key and then inserts the same tokens, often as a new
        key object; the tree has not changed in between (any change clears the
        walk), so its path still holds.  Returns ``(path, pos, ids)`` or None, where
        ``ids`` are the token ids to store: the matched key's own, already
        checked, when ``rk``'s are known valid or (``rk`` holding just those ``n``) that key's checked rest held no
        0 or 1 (a token equal to a checked id is taken as that id, as on the
        walked path, and with no 0 or 1 there is no bool either; ``rk`` is then
        neither converted nor scanned); else ``rk``'s, whose rest is checked here.
        """
        last = self._last_walk
        if last is None or last[1] != n:
            return None
        lrk, _, path, pos, no01 = last
        if lrk is not rk:
            if rk.extra_key != lrk.extra_key or not rk.same_prefix(lrk, n):
                return None
            if lrk.validated and (rk.validated or (no01 and len(rk) == n)):
                # rk stays as it was: its ids were compared, not checked (another cache checks them).  Only a
                # key of n tokens: ids past them (an unaligned tail) were never compared, so they are checked below.
                return path, pos, lrk.token_ids
        ids = rk.token_ids
        if not rk.validated:
            check_token_ids(ids, pos, refuse_bools=self.strict)
            rk.validated = True
        return path, pos, ids

    def match_prefix(self, key: KeyLike) -> MatchResult:
        rk = key if type(key) is RadixKey else as_radix_key(key, validate=False)
        ids = rk.token_ids
        n = len(ids)
        ps = self.page_size
        if ps > 1:
            n -= n % ps
        if self.disable or n == 0:
            if self._check_match_tail:
                check_token_ids(ids)
            return self._empty_match
        path, pos, split_child, m, no01 = self._walk(rk, n, self._check_match_tail)
        now = self.clock()
        self.root_node.last_access_time = now
        for x in path:
            x.last_access_time = now
        if split_child is not None:
            split_child.last_access_time = now
            path.append(self._split_node(split_child, m, now))
            pos += m
        # An engine inserts the key it just matched: remember the walk so that insert
        # need not repeat it while the tree's shape is unchanged.
        self._last_walk = (rk, n, path, pos, no01)
        if not path:
            return self._empty_match
        node = path[-1]
        value = node.value if len(path) == 1 else torch.cat([x.value for x in path])
        return MatchResult(value, node, node)

    def _split_node(self, child: TreeNode, m: int, now: float) -> TreeNode:
        """Cut ``child`` after ``m`` tokens; the new upper half takes its place and its lock.

        As in SGLang the upper half is a new node: created ``now`` (this matters to
        the ``fifo``/``filo`` policies once it becomes a leaf), with the lower half's
        access time, hit count and priority.
        """
        self._last_walk = None
        return split_node(child, m, TreeNode([], None, None, None, now), self.page_size)

    def insert(self, key: KeyLike, value: torch.Tensor | None = None, *, priority: int = 0,
               chunked: bool = False) -> InsertResult:
        """Insert ``key`` -> ``value`` (KV slots); returns the length that was already cached.

        Only whole pages are inserted.  Slots of the already-cached part are *not*
        freed here (the caller frees its duplicates).  ``value=None`` uses the token
        ids as values (SGLang's simulation mode: do not evict such entries into a
        real allocator).  ``priority`` feeds the ``priority`` policy; ``chunked``
        skips hit counting (a chunked prefill re-inserting its own prefix).
        """
        rk = key if type(key) is RadixKey else as_radix_key(key, validate=False)
        n = len(rk)
        if value is not None:
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"insert value must be a 1-D integer tensor of slots, got {type(value).__name__}")
            if value.dtype not in _INT_DTYPES or value.dim() != 1:
                raise TypeError(
                    f"insert value must be a 1-D integer tensor, got shape {tuple(value.shape)} dtype {value.dtype}"
                )
            if value.shape[0] != n:
                raise ValueError(f"insert value has {value.shape[0]} slots for a key of {n} tokens")
        ps = self.page_size
        if ps > 1:
            n -= n % ps
        return self._insert(rk, n, value, priority, chunked, False)

    def _insert(self, rk: RadixKey, n: int, value: torch.Tensor | None, priority: int | None, chunked: bool,
                row_checked: bool) -> InsertResult:
        """``insert`` of ``rk``'s first ``n`` (page-aligned) tokens; ``row_checked``: a request's row range
        holding ``value[n0:n]`` was checked claimable already, so the new leaf's slots are claimed unchecked."""
        if self.disable or n == 0:
            check_token_ids(rk.token_ids)
            return InsertResult(0, self.root_node)
        reused = self._reuse_walk(rk, n)
        if reused is not None:
            path, pos, ids = reused
            split_child, m = None, 0
        else:
            ids = rk.token_ids
            path, pos, split_child, m, _ = self._walk(rk, n)
        self._last_walk = None
        v = self._leaf_value(ids, value, pos + m, n, row_checked)
        # Nothing has changed so far; from here on the insert cannot fail.
        return self._commit_insert(path, split_child, m, ids, pos, n, v, priority, chunked, rk.extra_key)

    def _leaf_value(self, ids: list[int], value: torch.Tensor | None, start: int, n: int,
                    row_checked: bool = False) -> torch.Tensor | None:
        """The new leaf's own slots (``[start, n)`` of the key), claimed under strict; None when nothing is new."""
        if start >= n:
            return None
        if value is None:
            return torch.tensor(ids[start:n], dtype=torch.int64, device=self.device)
        if value.dtype is torch.int64:
            v = torch.narrow_copy(value, 0, start, n - start)  # one op: ~2x cheaper than slice + clone
        else:
            v = value[start:n].to(torch.int64)
        if self.strict:
            if row_checked:
                self._claims.claim(v, checked=False)
            else:
                # Refused (nothing changed) unless every new slot may become this tree's own.
                self._claims.check_claimable(v, commit=True)
        return v

    def _commit_insert(self, path: list, split_child: TreeNode | None, m: int, ids: list[int], pos: int, n: int,
                       v: torch.Tensor | None, priority: int | None, chunked: bool, extra_key: str | None,
                       base: int = 0) -> InsertResult:
        """The insert's changes once its walk is known: ``path`` (root side first) touched, the split, the new leaf.

        ``ids[pos:n]`` are the key's tokens past ``path`` (``base`` tokens in front of
        ``ids[0]``: a resumed insert's ids start below its locked node).
        """
        if priority is None:
            priority = 0
        hit = 0 if chunked else 1
        now = self.clock()
        root = node = self.root_node
        node.last_access_time = now
        if priority > node.priority:
            node.priority = priority
        for node in path:
            node.last_access_time = now
            node.hit_count += hit
            if priority > node.priority:
                node.priority = priority
        if split_child is not None:
            split_child.last_access_time = now
            node = self._split_node(split_child, m, now)
            node.hit_count += hit
            if priority > node.priority:
                node.priority = priority
            pos += m
        prefix_len = base + pos
        if v is not None:
            ps = self.page_size
            ck: Hashable = ids[pos] if ps == 1 else tuple(ids[pos : pos + ps])
            if node is root and extra_key is not None:
                ck = (extra_key, ck)
            leaf = TreeNode(ids[pos:n], v, node, ck, now, priority, extra_key)
            leaf.hit_count = hit
            node.children[ck] = leaf
            self._evictable_size += n - pos
            leaves = self._evictable_leaves
            leaves.discard(node)
            leaves.add(leaf)
            if self.enable_kv_events:
                record_stored(self._events, leaf, ps)
            node = leaf
        return InsertResult(prefix_len, node)

    # ------------------------------------------------------------------ locks

    def _path(self, node: TreeNode, what: str) -> list:
        if not isinstance(node, TreeNode):
            raise TypeError(f"{what}: expected a radix TreeNode, got {type(node).__name__}")
        return path_to_root(node, self.root_node, what)

    def inc_lock_ref(self, node: TreeNode) -> LockResult:
        if self.disable:
            return LockResult(delta=0)
        return LockResult(delta=self._lock(self._path(node, "inc_lock_ref")))

    def _lock(self, path: list) -> int:
        newly: list = []
        delta = lock_path(path, newly)
        if newly:
            self._evictable_leaves.difference_update(newly)
        self._evictable_size -= delta
        self._protected_size += delta
        return delta

    def dec_lock_ref(self, node: TreeNode, lock: LockResult | None = None) -> LockResult:
        if self.disable:
            return LockResult(delta=0)
        path = self._path(node, "dec_lock_ref")
        check_locked(path, node, "dec_lock_ref")
        if lock is not None:
            lock.check_not_released("dec_lock_ref", node)
            lock.released = True
        newly: list = []
        delta = unlock_path(path, newly)
        leaves = self._evictable_leaves
        for x in newly:
            if not x.children:
                leaves.add(x)
        self._evictable_size += delta
        self._protected_size -= delta
        return LockResult(delta=-delta)

    # ------------------------------------------------------------------ eviction

    def evict(self, num_tokens: int) -> EvictResult:
        num_tokens = check_evict_count(num_tokens)
        leaves = self._evictable_leaves
        if self.disable or num_tokens <= 0 or not leaves:
            return EvictResult(0)
        self._last_walk = None
        leaves.refresh()
        root = self.root_node
        events = self._events if self.enable_kv_events else None
        freed = []
        num = 0
        while num < num_tokens:
            x = leaves.pop()  # taken out of the set
            if x is None:
                break
            value = x.value
            freed.append(value)
            size = len(x.key)
            num += size
            parent = x.parent
            del parent.children[x.ck]
            self._evictable_size -= size
            if events is not None:
                record_removed(events, x)
            x.value = None
            x.parent = None
            if parent is not root and parent.lock_ref == 0 and not parent.children:
                leaves.add(parent)  # a candidate of this same call, as in SGLang
        if freed:
            self._free_evicted(freed)
        return EvictResult(num_tokens_evicted=num)

    def _free_evicted(self, freed: list) -> None:
        """Give evicted values back in SGLang's free-list order.

        SGLang frees each leaf with ``free_segment`` as it goes: appended at the back
        when ``page_size == 1``, paged in front in row order -- so, paged, the last
        leaf evicted ends up first.  One call here does the same.
        """
        alloc = self.token_to_kv_pool_allocator
        if alloc is None:
            return  # tree-only: the values are the caller's
        self.evicting(freed)
        if self.strict:
            self._claims.disown(freed[0] if len(freed) == 1 else torch.cat(freed))
        if self.page_size == 1:
            alloc.free(freed[0] if len(freed) == 1 else torch.cat(freed))
        else:
            alloc.free_row_segments([(freed[0] if len(freed) == 1 else torch.cat(freed[::-1]), 0)])

    # ------------------------------------------------------------------ requests

    def check_node_locked(self, node: Any, what: str) -> None:
        check_locked(self._path(node, what), node, what)

    def cache_finished_req(self, req: Req, is_insert: bool = True) -> None:
        self.check_req(req, "cache_finished_req")
        kv = req.kv
        committed = kv.kv_committed_len
        protected = kv.cache_protected_len
        if self.disable:
            self.free_kv_row(kv, [(protected, committed)])
        elif not is_insert:
            # Two pieces, as SGLang frees them (paged, the tail's page ends up in front).
            aligned = floor_align(committed, self.page_size)
            self.free_kv_row(kv, [(protected, aligned), (aligned, committed)])
        elif self.resume_finished(req):
            return  # inserted from the request's locked node (kvcore.tree.resume), lock given back
        else:
            aligned = floor_align(committed, self.page_size)
            result = self._insert_row(req, RadixKey(req.fill_ids[:aligned], req.extra_key), aligned, False)
            # Duplicates of what the tree already held, then the unaligned tail.
            self.free_kv_row(kv, [(protected, result.prefix_len), (aligned, committed)])
        self.release_req_lock(req)

    def cache_unfinished_req(self, req: Req, chunked: bool = False) -> None:
        if self.disable:
            return
        self.check_req(req, "cache_unfinished_req")
        if self.resume_unfinished(req, chunked):
            return
        kv = req.kv
        committed = kv.kv_committed_len
        protected = kv.cache_protected_len
        aligned = floor_align(committed, self.page_size)
        key = RadixKey(req.fill_ids[:aligned], req.extra_key)
        result = self._insert_row(req, key, aligned, chunked)
        self.free_kv_row(kv, [(protected, result.prefix_len)])

        match = self.match_prefix(key)
        if match.prefix_len != aligned:
            raise AssertionError(f"request {req.rid!r}: re-match found {match.prefix_len} of {aligned} inserted tokens")
        self.rebase_on_match(req, match, committed)
        self.note_resume_point(req, match.device_indices)

    def _insert_row(self, req: Req, key: RadixKey, aligned: int, chunked: bool) -> InsertResult:
        """Insert ``key`` (the request's first ``aligned`` tokens) -> its row's slots.

        Under strict the request's own part of the row, ``[cache_protected_len, aligned)``,
        is checked first as a whole (the row's claim: allocated, not a tree node's, named
        once, whole pages), before anything changes: it covers the new leaf's slots and
        the duplicates freed after the insert, so neither can be refused half-way.
        """
        kv = req.kv
        values = self.req_to_token_pool.req_to_token[kv.req_pool_idx, :aligned].to(torch.int64)
        if len(key) != aligned:
            raise ValueError(f"insert value has {aligned} slots for a key of {len(key)} tokens")
        protected = kv.cache_protected_len
        if self.strict and aligned > protected:
            self._claims.check_claimable(values[protected:], what=f"request {req.rid!r}")
        return self._insert(key, aligned, values, req.priority, chunked, self.strict)

    # -- the resumed insert's parts (kvcore.tree.resume) ----------------------

    def resume_insert(self, upper: list, ids: list[int], values: torch.Tensor, base: int, priority: int,
                      chunked: bool) -> tuple[int, Any, bool]:
        node = upper[-1]
        n = len(ids)
        path, pos, split_child, m = descend(node, ids, n, self.page_size)
        check_token_ids(ids, pos + m, refuse_bools=self.strict)
        self._last_walk = None
        v = self._leaf_value(ids, values, pos + m, n, self.strict)  # the row was checked (resume_unfinished)
        result = self._commit_insert(upper + path, split_child, m, ids, pos, n, v, priority, chunked,
                                     node.extra_key, base)
        return result.prefix_len, result.last_device_node, False

    def resume_stamp(self, node: Any) -> None:
        now = self.clock()
        root = self.root_node
        while node is not root:
            node.last_access_time = now
            node = node.parent
        root.last_access_time = now

    def resume_lock(self, nodes: list) -> int:
        return self._lock(nodes)

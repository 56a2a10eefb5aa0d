"""SWARadixCache: a radix tree over a full pool and a sliding-window pool.

Behaviour follows SGLang 0.5.19's ``SWARadixCache`` (written anew here):

* Every node holds full-pool slots.  A node whose window slots were freed (window
  eviction, or a request's out-of-window tail) is a *tombstone*: it keeps its full
  slots, has no window slots and is not in the window LRU.  Inserts and evictions
  never leave a tombstone leaf; a leaf that lost its window while fully locked
  (``dec_swa_lock_only``, window eviction) stays one, evictable, once unlocked.
* A match is valid up to a point with no tombstone on its path, or with at least
  ``sliding_window_size`` live tokens after the last tombstone; otherwise it falls
  back to the best earlier valid point.
* Two LRU orders: full eviction frees unlocked leaves (both sides) and then the
  tombstone leaves it uncovers; window eviction frees the window side of any
  node without a window lock, tombstoning internal nodes and deleting leaves.
* Locks: the full lock covers the path to the root; the window lock covers only
  the nodes holding the last ``sliding_window_size`` tokens and remembers where it
  stopped (``LockResult.stop``) so that the unlock stops there too.

Nodes, splits, lock walks, LRU lists and KV events come from :mod:`kvcore.tree`.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, cast

import torch

from kvcore.cache import BasePrefixCache, EvictResult, InsertResult, LockResult, MatchResult, SlotOwner
from kvcore.keys import KeyLike, RadixKey, checked_key
from kvcore.record import floor_align
from kvcore.tree import (
    KVEventLog,
    LRUList,
    Node,
    alloc_value,
    check_evict_count,
    check_locked,
    checked_value,
    child_key,
    edge_match_len,
    iter_subtree,
    join_values,
    lock_path,
    next_node_id,
    path_to_root,
    path_values,
    proven_prefix_len,
    record_removed,
    record_stored,
    request_ids,
    split_node,
    tree_lines,
    unlock_path,
)
from kvcore_swa.config import SWAConfig, require_swa_allocator
from kvcore_swa.window import SlidingWindowMixin, window_size

if TYPE_CHECKING:
    from kvcore.config import CacheInitParams
    from kvcore.pools import SWATokenToKVPoolAllocator
    from kvcore.record import Req, ReqKvInfo

__all__ = ["SWARadixCache", "SWATreeNode"]

_INF = float("inf")


class SWATreeNode(Node):
    """A node of the SWA radix tree: ``key`` tokens whose KV lives at ``value`` (full slots).

    On top of :class:`kvcore.tree.Node` (whose ``lock_ref`` is the full lock,
    also readable as SGLang's ``full_lock_ref``): ``tombstone`` (no window
    slots), ``swa_lock_ref``, ``swa_uuid`` (marks where a window lock stopped)
    and the links of the full (``prev``/``next``) and window
    (``swa_prev``/``swa_next``) LRU lists.
    """

    __slots__ = ("tombstone", "swa_lock_ref", "swa_uuid", "prev", "next", "swa_prev", "swa_next", "__weakref__")

    split_copy = ("lock_ref", "swa_lock_ref", "tombstone", "last_access_time", "hit_count")
    # A window lock that stopped at a node stopped at its top: the upper part.
    split_move = ("swa_uuid",)

    tombstone: bool
    swa_lock_ref: int
    swa_uuid: int | None
    prev: SWATreeNode | None
    next: SWATreeNode | None
    swa_prev: SWATreeNode | None
    swa_next: SWATreeNode | None

    def __init__(self) -> None:
        self.children = {}
        self.parent = None
        self.key = []
        self.value = None
        self.ck = None
        self.extra_key = None
        self.id = next_node_id()
        self.lock_ref = 0
        self.last_access_time = 0
        self.hit_count = 0
        self.hash_value = None
        self.tombstone = False
        self.swa_lock_ref = 0
        self.swa_uuid = None
        self.prev = self.next = None
        self.swa_prev = self.swa_next = None

    @property
    def full_lock_ref(self) -> int:  # SGLang's name
        return self.lock_ref

    @full_lock_ref.setter
    def full_lock_ref(self, value: int) -> None:
        self.lock_ref = value

    @property
    def swa_tombstone(self) -> bool:  # SGLang's name
        return self.tombstone

    @property
    def evicted(self) -> bool:
        return self.value is None

    def __len__(self) -> int:
        return len(self.key)

    def __repr__(self) -> str:
        ids = self.key if len(self.key) <= 6 else f"{self.key[:6]}...+{len(self.key) - 6}"
        return (
            f"SWATreeNode(id={self.id}, key={ids}, full_lock={self.lock_ref}, "
            f"swa_lock={self.swa_lock_ref}, tombstone={self.tombstone})"
        )


class SWARadixCache(SlidingWindowMixin, KVEventLog, BasePrefixCache):
    """SGLang's SWARadixCache on a :class:`kvcore.pools.SWATokenToKVPoolAllocator`.

    The class is its own factory: ``SWARadixCache(params)`` with a
    :class:`kvcore.CacheInitParams` whose config carries ``sliding_window_size``.
    """

    token_to_kv_pool_allocator: SWATokenToKVPoolAllocator
    supports_window_lock_release = True

    def __init__(self, params: CacheInitParams, sliding_window_size: int | None = None):
        alloc = require_swa_allocator(params.token_to_kv_pool_allocator, "SWARadixCache")
        super().__init__(params)
        config = cast(SWAConfig, params.config)
        self.config = config
        self.token_to_kv_pool_allocator = alloc
        self.device = alloc.device
        self.sliding_window_size = window_size(config, sliding_window_size)
        self.disable = bool(config.disable)
        # strict (set by the base): the tree claims the full slots it keeps (refusing free, padding,
        # out-of-range, duplicated or already-owned ones before anything changes) and disowns them when freed.
        self.enable_kv_events = bool(config.enable_kv_events)
        self.eviction_policy = config.eviction_policy
        self._empty = torch.empty((0,), dtype=torch.int64, device=self.device)
        self._uuids = itertools.count(1)
        self._clock = itertools.count(1)
        self._events: list[Any] = []
        self._build_empty()

    # ------------------------------------------------------------------ state

    def _build_empty(self) -> None:
        root = SWATreeNode()
        root.value = self._empty
        root.lock_ref = 1
        root.swa_lock_ref = 1
        root.hash_value = []
        self.root_node = root
        self.full_lru = LRUList(SWATreeNode, "prev", "next", "lock_ref", "full LRU")
        # The window list never holds a tombstone.
        self.swa_lru = LRUList(SWATreeNode, "swa_prev", "swa_next", "swa_lock_ref", "window LRU")
        self.full_evictable_size_ = 0
        self.full_protected_size_ = 0
        self.swa_evictable_size_ = 0
        self.swa_protected_size_ = 0

    def reset(self) -> None:
        """Free every node's slots and start from an empty tree.

        Locks held on the old tree die with it: call this only when no request runs.
        """
        nodes = list(iter_subtree(self.root_node))
        frees: list[tuple[str, torch.Tensor]] = [("full" if node.tombstone else "both", node.value) for node in nodes]
        for node in nodes:
            node.parent = None
        self._free_batch(frees)
        self._build_empty()
        self.record_cleared()

    # ------------------------------------------------------------------ sizes

    def full_evictable_size(self) -> int:
        return self.full_evictable_size_

    def swa_evictable_size(self) -> int:
        return self.swa_evictable_size_

    def full_protected_size(self) -> int:
        return self.full_protected_size_

    def swa_protected_size(self) -> int:
        return self.swa_protected_size_

    def evictable_size(self) -> int:
        return self.full_evictable_size_

    def protected_size(self) -> int:
        return self.full_protected_size_

    def total_size(self) -> int:
        return self.full_evictable_size_ + self.full_protected_size_

    def swa_total_size(self) -> int:
        return self.swa_evictable_size_ + self.swa_protected_size_

    # ------------------------------------------------------------------ keys

    def _prepare_key(self, key: KeyLike) -> tuple[list[int], str | None, int]:
        rk = checked_key(key)
        ids = rk.token_ids
        return ids, rk.extra_key, floor_align(len(ids), self.page_size)

    def _tick(self) -> int:
        return next(self._clock)

    # ------------------------------------------------------------------ match

    def match_prefix(self, key: KeyLike) -> MatchResult:
        """The longest cached prefix usable for sliding-window attention.

        The result stops at the last point whose path either has no tombstone or
        has at least ``sliding_window_size`` live tokens after its last tombstone.
        """
        ids, extra_key, n = self._prepare_key(key)
        root = self.root_node
        if self.disable or n == 0:
            return MatchResult(self._empty, root, root, 0)
        window = self.sliding_window_size
        node = root
        pos = 0
        values: list[torch.Tensor] = []
        since_tombstone = _INF  # a path with no tombstone is always valid
        best_items = 0
        best_node = root
        best_len = 0
        matched = 0
        ps = self.page_size
        while pos < n:
            child = node.children.get(child_key(ids, pos, ps, extra_key if pos == 0 else None))
            if child is None:
                break
            if child.tombstone:
                if since_tombstone >= window:
                    best_items, best_node, best_len = len(values), node, matched
                since_tombstone = 0
            plen = edge_match_len(ids, pos, child.key, n, ps)
            if plen < len(child.key):
                child = self._split(child, plen)
            values.append(child.value)
            matched += plen
            if not child.tombstone:
                since_tombstone += plen
            node = child
            pos += plen
        if since_tombstone >= window:
            best_items, best_node, best_len = len(values), node, matched

        if best_node is not root:
            self.full_lru.touch_path(best_node, root)
            self.swa_lru.touch_path(best_node, root)
            t = self._tick()
            x = best_node
            while x is not root:
                x.last_access_time = t
                x.hit_count += 1
                x = x.parent
        indices = join_values(values[:best_items], self._empty)
        return MatchResult(
            indices,
            best_node,
            best_node,
            best_len,
            {"matched_len": matched, "tombstone_limited": best_len < matched},
        )

    # ------------------------------------------------------------------ insert

    def insert(
        self,
        key: KeyLike,
        value: torch.Tensor | None = None,
        prev_prefix_len: int = 0,
        swa_evicted_seqlen: int = 0,
    ) -> InsertResult:
        """Cache ``value`` (full slots) under ``key``.

        Positions ``[prev_prefix_len, len)`` of ``value`` are the caller's own slots:
        those the tree already holds are freed here (the caller's copy), a tombstone
        they cover is healed with the caller's live window slots, and the part below
        ``swa_evicted_seqlen`` (window slots already gone) is stored as tombstone.
        With ``value=None`` fresh slots are allocated for the key.
        """
        ids, extra_key, n = self._prepare_key(key)
        ps = self.page_size
        if not isinstance(prev_prefix_len, int) or isinstance(prev_prefix_len, bool) or prev_prefix_len < 0:
            raise ValueError(f"prev_prefix_len must be a non-negative int, got {prev_prefix_len!r}")
        if not isinstance(swa_evicted_seqlen, int) or isinstance(swa_evicted_seqlen, bool) or swa_evicted_seqlen < 0:
            raise ValueError(f"swa_evicted_seqlen must be a non-negative int, got {swa_evicted_seqlen!r}")
        if prev_prefix_len % ps or swa_evicted_seqlen % ps:
            raise ValueError(
                f"prev_prefix_len={prev_prefix_len} and swa_evicted_seqlen={swa_evicted_seqlen} "
                f"must be multiples of page_size={ps}"
            )
        if prev_prefix_len > n:
            raise ValueError(
                f"prev_prefix_len={prev_prefix_len} is longer than the page-aligned key ({n} tokens)"
            )
        if value is None:
            if self.disable or n == 0:
                return InsertResult(0, self.root_node, duplicates_freed=True)
            value = alloc_value(self.token_to_kv_pool_allocator, n)
            prev_prefix_len = 0
            swa_evicted_seqlen = 0
        else:
            value = checked_value(value, len(ids), n, self.device)
        if self.disable:
            return InsertResult(0, self.root_node, duplicates_freed=True)
        if n == 0:
            return InsertResult(0, self.root_node, duplicates_freed=True)
        if value.shape[0] != n:
            value = value[:n]
        if self.strict:
            # prev_prefix_len never narrows the check: only the tree's own slots skip it.
            lo = 0
            if prev_prefix_len:
                lo = proven_prefix_len(self.root_node, ids, n, ps, extra_key, value, prev_prefix_len)
            self._check_slots(value, lo, n)
        if swa_evicted_seqlen > prev_prefix_len:
            # The caller says these window slots are gone; make sure they are.
            self._release_window(value[prev_prefix_len : min(swa_evicted_seqlen, n)])
        prefix_len, last = self._insert(ids, extra_key, n, value, prev_prefix_len, swa_evicted_seqlen)
        return InsertResult(prefix_len, last, duplicates_freed=True)

    def _check_slots(self, value: torch.Tensor, lo: int, hi: int, what: str = "insert") -> None:
        """Refuse (nothing changed) unless ``value[lo:hi]``, the caller's own slots, may enter the tree."""
        if hi > lo:
            # A slice is a tensor operation too: skip it when the whole value is meant.
            part = value if lo == 0 and hi == value.shape[0] else value[lo:hi]
            self.token_to_kv_pool_allocator.check_claimable(part, what=what)

    def _release_window(self, slots: torch.Tensor) -> None:
        """Free whatever window side ``slots`` still map to (already-unmapped ones are skipped)."""
        if slots.numel():
            self.token_to_kv_pool_allocator.free_swa(slots)

    def _insert(
        self,
        ids: list[int],
        extra_key: str | None,
        n: int,
        value: torch.Tensor,
        prev: int,
        sev: int,
        owned: bool = False,
    ) -> tuple[int, SWATreeNode]:
        """Walk/extend the tree with ``ids[:n]`` -> ``value[:n]``; returns (prefix length, last node).

        ``owned``: ``value`` is a copy made for this call (a request's row read out), so the
        new nodes may keep views of it; otherwise the new part is copied (the caller keeps its tensor).
        """
        alloc = self.token_to_kv_pool_allocator
        root = self.root_node
        node = root
        pos = 0
        t = self._tick()
        ps = self.page_size
        while pos < n:
            child = node.children.get(child_key(ids, pos, ps, extra_key if pos == 0 else None))
            if child is None:
                break
            # Root-to-leaf order: a child is more recent than its parent, so window
            # eviction tombstones nodes near the root first.  As in SGLang the node is
            # touched before it is split, so a split leaves the lower part more recent.
            child.last_access_time = t
            self.full_lru.touch(child)
            if not child.tombstone:
                self.swa_lru.touch(child)
            plen = edge_match_len(ids, pos, child.key, n, ps)
            if plen < len(child.key):
                child = self._split(child, plen)
            end = pos + plen
            if prev < end:
                if prev > pos:
                    # Only [prev, end) is the caller's; split so that one node is wholly theirs.
                    self._split(child, prev - pos)
                    pos = prev
                self._adopt_duplicate(child, value, pos, end, sev)
            node = child
            pos = end
        prefix_len = pos
        if pos < n:
            if sev >= n:
                # Nothing of the new part has window slots left, and a leaf may not be
                # a tombstone: the tree does not take it.
                alloc.free_full(value[pos:n])
                return prefix_len, node
            # One copy (and one claim) for the whole new part; the nodes keep views of it.
            tail = value[pos:n] if pos or n != value.shape[0] else value
            if not owned:
                tail = tail.clone()
            if self.strict:
                alloc.claim(tail, checked=False)
            if sev > pos:
                node = self._add_node(node, ids[pos:sev], extra_key, tail[: sev - pos], tombstone=True)
                tail = tail[sev - pos :]
                pos = sev
            node = self._add_node(node, ids[pos:n], extra_key, tail, tombstone=False)
        return prefix_len, node

    def _adopt_duplicate(self, node: SWATreeNode, value: torch.Tensor, pos: int, end: int, sev: int) -> None:
        """``node`` holds ``[pos, end)``; the caller's copy ``value[pos:end]`` is redundant."""
        alloc = self.token_to_kv_pool_allocator
        incoming = value[pos:end]
        if not node.tombstone:
            alloc.free_row_segments([(incoming, pos)], swa_evicted_seqlen=sev)
            return
        if sev >= end:
            # The caller's window slots are gone too: nothing to heal with.
            alloc.free_full(incoming)
            return
        if sev > pos:
            k = sev - pos
            self._split(node, k)  # the upper part [pos, sev) stays a tombstone
            alloc.free_full(incoming[:k])
            incoming = incoming[k:]
        self._heal(node, incoming)

    def _heal(self, node: SWATreeNode, incoming: torch.Tensor) -> None:
        """Give tombstone ``node`` the window slots of ``incoming`` (same tokens, live window)."""
        assert node.tombstone and node.swa_lock_ref == 0, node
        alloc = self.token_to_kv_pool_allocator
        if node.lock_ref > 0:
            # A running request reads node.value: keep those full slots and point them
            # at the incoming window slots instead.
            mapping = alloc.full_to_swa_index_mapping
            mapping[node.value] = mapping[incoming]
            mapping[incoming] = 0
            alloc.free_full(incoming)
        else:
            if self.strict:
                alloc.disown(node.value)
                alloc.claim(incoming, checked=False)
            alloc.free_full(node.value)
            node.value = incoming.clone()
        node.tombstone = False
        self.swa_lru.add_mru(node)
        self.swa_evictable_size_ += len(node.key)

    def _add_node(
        self, parent: SWATreeNode, key: list[int], extra_key: str | None, value: torch.Tensor, tombstone: bool
    ) -> SWATreeNode:
        """A new child of ``parent``; ``value`` is the tree's own copy, already claimed under ``strict``."""
        node = SWATreeNode()
        node.parent = parent
        node.key = key
        node.extra_key = extra_key
        node.value = value
        node.tombstone = tombstone
        node.last_access_time = self._tick()
        ps = self.page_size
        node.ck = child_key(key, 0, ps, extra_key if parent is self.root_node else None)
        parent.children[node.ck] = node
        self.full_lru.add_mru(node)
        self.full_evictable_size_ += len(key)
        if not tombstone:
            self.swa_lru.add_mru(node)
            self.swa_evictable_size_ += len(key)
        if self.enable_kv_events:
            record_stored(self._events, node, ps)
        return node

    def _split(self, child: SWATreeNode, k: int) -> SWATreeNode:
        """Split ``child`` after ``k`` tokens; returns the new upper node, ``child`` keeps the rest."""
        assert 0 < k < len(child.key) and k % self.page_size == 0, (k, child)
        up = split_node(child, k, SWATreeNode(), self.page_size)
        # Keep the upper part older than the child in both orders.
        self.full_lru.remove(child)
        self.full_lru.add_mru(up)
        self.full_lru.add_mru(child)
        if not child.tombstone:
            self.swa_lru.remove(child)
            self.swa_lru.add_mru(up)
            self.swa_lru.add_mru(child)
        return up

    # ------------------------------------------------------------------ locks

    def _path(self, node: SWATreeNode, what: str) -> list[SWATreeNode]:
        if not isinstance(node, SWATreeNode):
            raise TypeError(f"{what}: expected a node of this cache, got {type(node).__name__}")
        return path_to_root(node, self.root_node, what)

    def _window_stop(self, path: list[SWATreeNode]) -> int:
        """How many nodes of ``path`` (leaf first) a window lock taken now covers."""
        window = self.sliding_window_size
        size = 0
        for i, x in enumerate(path):
            if x.tombstone:
                return i
            size += len(x.key)
            if size >= window:
                return i + 1
        return len(path)

    def inc_lock_ref(self, node: Any) -> LockResult:
        """Lock ``node``'s path: full side to the root, window side for the last W tokens."""
        if node is None or node is self.root_node or self.disable:
            return LockResult(0, None, {"swa_delta": 0, "swa_tokens": 0})
        path = self._path(node, "inc_lock_ref")
        k = self._window_stop(path)
        full_delta = lock_path(path)
        self.full_evictable_size_ -= full_delta
        self.full_protected_size_ += full_delta
        swa_delta = swa_tokens = 0
        for x in path[:k]:
            n = len(x.key)
            if x.swa_lock_ref == 0:
                self.swa_evictable_size_ -= n
                self.swa_protected_size_ += n
                swa_delta += n
            x.swa_lock_ref += 1
            swa_tokens += n
        stop = None
        # As SGLang, a lock that reached the window gets a stop marker even when it
        # reached it at the node under the root (the unlock then stops there too).
        if 0 < k and (k < len(path) or swa_tokens >= self.sliding_window_size):
            top = path[k - 1]
            if top.swa_uuid is None:
                top.swa_uuid = next(self._uuids)
            stop = top.swa_uuid
        return LockResult(full_delta, stop, {"swa_delta": swa_delta, "swa_tokens": swa_tokens})

    def _swa_locked_nodes(self, path: list[SWATreeNode], lock: LockResult | None, what: str) -> list[SWATreeNode]:
        """The nodes of ``path`` that ``lock``'s window lock covers (leaf first)."""
        if lock is None:
            # No record: assume the lock a fresh inc_lock_ref would take here.
            k = self._window_stop(path)
            return path[:k]
        if lock.swa_released or lock.extras.get("swa_tokens", 1) == 0:
            return []
        stop = lock.stop
        if stop is None:
            return path
        for i, x in enumerate(path):
            if x.swa_uuid == stop:
                return path[: i + 1]
        raise ValueError(f"{what}: the window lock's stop marker {stop!r} is not on {path[0]}'s path")

    def dec_lock_ref(self, node: Any, lock: LockResult | None = None) -> LockResult:
        """Give back what ``inc_lock_ref(node)`` returned as ``lock``."""
        if lock is not None:
            lock.check_not_released("dec_lock_ref", node)
        if node is None or node is self.root_node or self.disable:
            if lock is not None:
                lock.released = True
            return LockResult(0, None, {"swa_delta": 0})
        path = self._path(node, "dec_lock_ref")
        check_locked(path, node, "dec_lock_ref")
        swa_nodes = self._swa_locked_nodes(path, lock, "dec_lock_ref")
        for x in swa_nodes:
            if x.tombstone or x.swa_lock_ref <= 0:
                raise ValueError(f"dec_lock_ref: {x} holds no window lock to give back")
        full_delta = -unlock_path(path)
        self.full_evictable_size_ -= full_delta
        self.full_protected_size_ += full_delta
        swa_delta = self._dec_swa(swa_nodes, tombstone_leaves=False)
        if lock is not None:
            lock.released = True
        # A leaf whose window went early (dec_swa_lock_only, or window eviction under a
        # full lock) stays as an unlocked tombstone leaf, as in SGLang: its full slots
        # are evictable and the next full eviction takes it (and the tombstones above).
        return LockResult(full_delta, None, {"swa_delta": swa_delta})

    def _dec_swa(self, nodes: list[SWATreeNode], tombstone_leaves: bool) -> int:
        delta = 0
        for x in nodes:
            if x.swa_lock_ref == 1:
                n = len(x.key)
                self.swa_protected_size_ -= n
                delta -= n
                if tombstone_leaves and not x.children:
                    # A leaf still fully locked cannot go to the window LRU (window eviction
                    # would delete it): free its window side now and make it a tombstone.
                    self.token_to_kv_pool_allocator.free_swa(x.value)
                    self.swa_lru.remove(x)
                    x.tombstone = True
                else:
                    self.swa_evictable_size_ += n
            x.swa_lock_ref -= 1
        return delta

    def dec_swa_lock_only(self, node: Any, lock: LockResult | None = None) -> LockResult:
        """Release only the window part of ``lock`` (the full lock stays).

        For a request whose decode moved past the window: its prefix's window slots
        become evictable; a leaf loses its window slots at once (it becomes a
        tombstone until the full lock goes).  ``dec_lock_ref(node, lock)`` later
        gives back only the full side.
        """
        if node is None or node is self.root_node or self.disable:
            return LockResult(0, None, {"swa_delta": 0})
        path = self._path(node, "dec_swa_lock_only")
        if lock is not None:
            lock.check_not_released("dec_swa_lock_only", node)
            if lock.swa_released:
                raise ValueError(f"dec_swa_lock_only: the window lock on {node} was already released")
        swa_nodes = self._swa_locked_nodes(path, lock, "dec_swa_lock_only")
        # Without a record, a lock taken now would cover nothing (a tombstone leaf): no window lock is held.
        for x in swa_nodes or ([node] if lock is None else []):
            if x.tombstone or x.swa_lock_ref <= 0 or x.lock_ref <= 0:
                where = "" if x is node else f" ({x!r} on its path holds none)"
                raise ValueError(
                    f"dec_swa_lock_only: {node!r} holds no window lock to give back{where}; pass the node and the "
                    "lock that inc_lock_ref returned, once (nothing was changed)"
                )
        delta = self._dec_swa(swa_nodes, tombstone_leaves=True)
        if lock is not None:
            lock.released_early.add("swa")
        return LockResult(0, None, {"swa_delta": delta})

    # ------------------------------------------------------------------ evict

    def evict(self, num_tokens: int, swa_num_tokens: int = 0) -> EvictResult:
        """Free at least ``num_tokens`` full slots and ``swa_num_tokens`` window slots, if it can."""
        num_tokens = check_evict_count(num_tokens)
        swa_num_tokens = check_evict_count(swa_num_tokens, "swa_num_tokens")
        if self.disable:
            return EvictResult(0, 0)
        root = self.root_node
        full_evicted = swa_evicted = 0
        # The slots go back to the pools once the walk is done (_free_batch), in the order
        # SGLang frees them node by node: live leaves (both sides), tombstones (full side
        # only) and window-only frees of the nodes tombstoned here.
        frees: list[tuple[str, torch.Tensor]] = []

        if num_tokens > 0:
            x = self.full_lru.lru_unlocked(leaf_only=True)
            while full_evicted < num_tokens and x is not None:
                nxt = self.full_lru.prev_unlocked(x, leaf_only=True)
                parent = x.parent
                n = len(x.key)
                full_evicted += n
                if not x.tombstone:
                    swa_evicted += n
                self._delete_leaf(x, frees)
                top, freed = self._prune_tombstones(parent, frees)
                full_evicted += freed
                if top is not root and not top.children:
                    # An ancestor became a leaf and may be older than nxt.
                    nxt = self.full_lru.lru_unlocked(leaf_only=True)
                x = nxt

        if swa_evicted < swa_num_tokens:
            x = self.swa_lru.lru_unlocked()
            while swa_evicted < swa_num_tokens and x is not None:
                nxt = self.swa_lru.prev_unlocked(x)
                n = len(x.key)
                if x.children or x.lock_ref > 0:
                    frees.append(("swa", x.value))
                    self.swa_lru.remove(x)
                    x.tombstone = True
                    self.swa_evictable_size_ -= n
                    swa_evicted += n
                else:
                    parent = x.parent
                    full_evicted += n
                    swa_evicted += n
                    self._delete_leaf(x, frees)
                    # The tombstone leaves this uncovers go too, and are counted.  (SGLang's
                    # window phase frees them without counting them: its num_tokens_evicted
                    # under-reports the full pool's gain there.  Ours is the pool's gain.)
                    _, freed = self._prune_tombstones(parent, frees)
                    full_evicted += freed
                x = nxt
        self._free_batch(frees)
        return EvictResult(full_evicted, swa_evicted)

    def _free_batch(self, frees: list[tuple[str, torch.Tensor]]) -> None:
        """Give back what an eviction took, in the order the walk took it (``both`` / ``full`` / ``swa`` sides).

        The free-list order is SGLang's, whose eviction frees node by node.  At page 1 a free
        appends its slots (both pools, and the window side read through the map, which the
        walk does not change), so a run of frees of one kind goes back in one call (a free
        costs a dozen tensor operations whatever its size); with pages each free sorts its
        pages and puts them first, so every node's free is a call of its own.
        """
        if not frees:
            return
        alloc = self.token_to_kv_pool_allocator
        empty = self._empty
        if self.strict:
            owned = [v for kind, v in frees if kind != "swa"]
            if owned:
                alloc.disown(join_values(owned, empty))
        calls: list[tuple[str, list[torch.Tensor]]] = []
        for kind, value in frees:
            if calls and calls[-1][0] == kind and self.page_size == 1:
                calls[-1][1].append(value)
            else:
                calls.append((kind, [value]))
        for kind, values in calls:
            slots = join_values(values, empty)
            if kind == "both":
                alloc.free(slots)
            elif kind == "full":
                alloc.free_full(slots)
            else:
                alloc.free_swa(slots)

    def _delete_leaf(self, x: SWATreeNode, frees: list[tuple[str, torch.Tensor]]) -> None:
        """Remove unlocked leaf ``x`` (both LRUs, its parent, the size counters).

        Its slots are appended to ``frees`` (``both`` sides of a node with window slots,
        the ``full`` side of a tombstone) for the caller to free (``_free_batch``).
        """
        assert not x.children and x.lock_ref == 0, x
        n = len(x.key)
        self.full_lru.remove(x)
        self.full_evictable_size_ -= n
        if x.tombstone:
            frees.append(("full", x.value))
        else:
            frees.append(("both", x.value))
            self.swa_lru.remove(x)
            self.swa_evictable_size_ -= n
        del x.parent.children[x.ck]
        x.parent = None
        x.value = None
        if self.enable_kv_events:
            record_removed(self._events, x)

    def _prune_tombstones(self, node: SWATreeNode, frees: list[tuple[str, torch.Tensor]]) -> tuple[SWATreeNode, int]:
        """Delete unlocked tombstone leaves from ``node`` upward (their slots to ``frees``).

        Returns (first kept node, tokens taken).
        """
        root = self.root_node
        freed = 0
        while node is not root and node.tombstone and not node.children and node.lock_ref == 0:
            parent = node.parent
            freed += len(node.key)
            self._delete_leaf(node, frees)
            node = parent
        return node, freed

    # ------------------------------------------------------------------ requests

    def _row(self, kv: ReqKvInfo) -> torch.Tensor:
        return self.req_to_token_pool.req_to_token[kv.req_pool_idx]

    def _settle_window(self, kv: ReqKvInfo, upto: int) -> None:
        """Make ``[cache_protected_len, min(swa_evicted_seqlen, upto))`` hold no window slots.

        The record says they are gone.  The cursor only ever frees what it passes,
        except where it jumps to ``swa_dead_lo`` over ``[cache_protected_len,
        swa_evict_floor)``: window slots there may still be mapped.
        """
        lo = kv.cache_protected_len
        hi = min(kv.swa_evicted_seqlen, upto, kv.swa_dead_lo(self.page_size))
        if hi > lo:
            self._release_window(self._row(kv)[lo:hi].to(torch.int64))

    def check_node_locked(self, node: Any, what: str) -> None:
        if node is not self.root_node:
            check_locked(self._path(node, what), node, what)

    def _req_values(self, req: Req, aligned: int) -> torch.Tensor:
        """``req``'s row up to ``aligned`` as int64 slots; under ``strict`` its ``[cache_protected_len, aligned)``
        must be slots that may enter the tree (refused before anything changes)."""
        kv = req.kv
        values = self._row(kv)[:aligned].to(torch.int64, copy=True)
        if self.strict and aligned > kv.cache_protected_len:
            self._check_slots(values, kv.cache_protected_len, aligned, f"request {req.rid!r}")
        return values

    def cache_finished_req(self, req: Req, is_insert: bool = True) -> None:
        """Insert what ``req`` committed (the window-evicted part as tombstone) and drop its lock."""
        kv = req.kv
        committed = kv.kv_committed_len
        protected = kv.cache_protected_len
        if self.disable:
            self.free_kv_row(kv, [(protected, committed)])
            self.release_req_lock(req)
            return
        self.check_req(req, "cache_finished_req")
        aligned = floor_align(committed, self.page_size)
        # Even with nothing new (aligned == protected) the insert walk touches the
        # path in both LRU orders, as SGLang's does.
        insert = is_insert and aligned > 0 and aligned >= protected
        if insert:
            # Read and checked before anything changes.
            values = self._req_values(req, aligned)
            ids = request_ids(req, aligned)
        self._settle_window(kv, committed)
        if insert:
            self._insert(ids, req.extra_key, aligned, values, protected, kv.swa_evicted_seqlen, owned=True)
        elif aligned > protected:
            self.free_kv_row(kv, [(protected, aligned)])
        # The unaligned tail (a partial page) never enters the tree.
        if committed > max(aligned, protected):
            self.free_kv_row(kv, [(max(aligned, protected), committed)])
        self.release_req_lock(req)

    def cache_unfinished_req(self, req: Req, chunked: bool = False) -> None:
        """Insert ``fill_ids[:kv_committed_len]`` of a running request and move its lock there.

        As SGLang: insert (which touches the path), then match the same key (which
        touches it again, parents older than children) and lock the end of the
        inserted path.  Where the match comes back shorter than the inserted key (a
        tombstone-limited path), SGLang takes the shorter match, leaving the part
        in between owned by both the tree and the request; the prefix and the lock
        are read from the inserted path instead.
        """
        kv = req.kv
        committed = kv.kv_committed_len
        row = self._row(kv)
        if self.disable:
            req.prefix_indices = row[:committed].to(torch.int64, copy=True)
            return
        self.check_req(req, "cache_unfinished_req")
        protected = kv.cache_protected_len
        aligned = floor_align(committed, self.page_size)
        values = self._req_values(req, aligned) if aligned > protected else None
        self._settle_window(kv, committed)
        sev = kv.swa_evicted_seqlen
        if aligned == 0 or aligned < protected or sev >= aligned:
            # Nothing the tree could keep as a live leaf.
            req.prefix_indices = row[:committed].to(torch.int64, copy=True)
            return
        ids = request_ids(req, aligned)
        if values is None:
            values = row[:aligned].to(torch.int64, copy=True)
        _, last = self._insert(ids, req.extra_key, aligned, values, protected, sev, owned=True)
        # SGLang re-matches the key here; the match's LRU touches (parents older than
        # children) decide later evictions, so do the same.
        m = self.match_prefix(RadixKey(ids, req.extra_key))
        if m.last_device_node is last:
            tree_values = m.device_indices
        else:
            tree_values = path_values(last, self.root_node, self._empty)
        assert tree_values.numel() == aligned, (tree_values.numel(), aligned)
        new_len = aligned
        row[protected:new_len] = tree_values[protected:].to(row.dtype)
        kv.cache_protected_len = new_len
        new_lock = self.inc_lock_ref(last)
        self.release_req_lock(req)
        req.lock = new_lock
        req.last_node = last
        if new_len < committed:
            req.prefix_indices = torch.cat([tree_values, row[new_len:committed].to(torch.int64)])
        else:
            req.prefix_indices = tree_values

    # ------------------------------------------------------------------ introspection

    def _nodes(self) -> Iterator[SWATreeNode]:
        return iter_subtree(self.root_node)

    def iter_owned_slots(self) -> Iterator[SlotOwner]:
        translate = self.token_to_kv_pool_allocator.translate_loc_from_full_to_swa
        for node in self._nodes():
            owner = f"tree node {node.id} ({len(node.key)} tokens{', tombstone' if node.tombstone else ''})"
            yield SlotOwner("full", owner, node.value)
            if not node.tombstone:
                yield SlotOwner("swa", owner, translate(node.value))

    def sanity_check(self) -> None:
        """Recount every size and check the tree's structural invariants (debug/tests)."""
        fe = fp = se = sp = 0
        full_in = swa_in = 0
        root = self.root_node
        for x in self._nodes():
            n = len(x.key)
            assert n > 0 and n % self.page_size == 0 and x.value.numel() == n, x
            assert x.parent is not None and x.parent.children.get(x.ck) is x, x
            assert x.lock_ref >= x.swa_lock_ref >= 0, x
            assert x in self.full_lru, x
            full_in += 1
            if x.lock_ref:
                fp += n
            else:
                fe += n
            if x.tombstone:
                assert x.swa_lock_ref == 0 and x not in self.swa_lru, x
            else:
                assert x in self.swa_lru, x
                swa_in += 1
                if x.swa_lock_ref:
                    sp += n
                else:
                    se += n
        assert (fe, fp, se, sp) == (
            self.full_evictable_size_,
            self.full_protected_size_,
            self.swa_evictable_size_,
            self.swa_protected_size_,
        ), ((fe, fp, se, sp), self.cached_sizes())
        assert full_in == self.full_lru.count == sum(1 for _ in self.full_lru), (full_in, self.full_lru.count)
        assert swa_in == self.swa_lru.count == sum(1 for _ in self.swa_lru), (swa_in, self.swa_lru.count)
        assert root not in self.full_lru and root not in self.swa_lru

    def format_tree(self) -> str:
        return "\n".join(tree_lines(self.root_node))

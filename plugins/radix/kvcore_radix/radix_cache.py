"""A radix-tree prefix cache over kvcore's pools (SGLang RadixCache semantics).

Hot-path notes: keys are plain Python lists and whole node keys are compared
with one C-level slice comparison (``ids[pos:end] == node.key``); only when that
fails is the mismatch point found by bisection over slice comparisons.  Node
values stay tensors (split halves are views, never re-copied) and ``match_prefix``
concatenates once at the end.  One clock reading per call, ``__slots__`` nodes.
"""

from __future__ import annotations

import heapq
from array import array
import itertools
import sys
import time
from typing import Iterator, Literal, Optional

import torch

from kvcore.cache import BasePrefixCache, EvictResult, InsertResult, LockResult, MatchResult, SlotOwner
from kvcore.config import CacheInitParams, TreeCacheConfig
from pydantic import Field
from kvcore.keys import KeyLike, RadixKey, as_radix_key
from kvcore.record import floor_align

from kvcore_radix.events import AllPagesCleared, PageRemoved, PageStored, chain_page_hashes
from kvcore_radix.policies import resolve_policy

__all__ = ["RadixCache", "RadixConfig", "TreeNode"]

_ids = itertools.count(1)
_INT_DTYPES = frozenset({torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8})


def _validate(ids: list, start: int) -> None:
    """Raise as ``kvcore.keys.as_radix_key`` does unless ``ids[start:]`` are non-negative ints.

    ``array('Q', ...)`` checks type and sign in one C pass; only on failure does the
    slower canonical validator run, to produce its error message.
    """
    if start >= len(ids):
        return
    rest = ids[start:] if start else ids
    try:
        array("Q", rest)
        return
    except (TypeError, OverflowError, ValueError):
        pass
    as_radix_key(RadixKey(rest))  # the canonical error, when it spots the bad id
    for t in rest:
        if not isinstance(t, int):
            raise TypeError(f"token ids must be ints, got {type(t).__name__} ({t!r})")
        if t < 0:
            raise ValueError(f"token ids must be non-negative, got {t}")
    raise ValueError(f"token ids must fit in 64 bits, got {max(rest)}")


class RadixConfig(TreeCacheConfig):
    """Options of the ``radix`` backend: the common pool options plus
    ``eviction_policy``, ``enable_kv_events``, ``disable`` and ``key_validation``."""

    key_validation: Literal["full", "stored"] = Field(
        "full",
        description="full: every key is checked (TypeError/ValueError on bad ids); "
        "stored: only ids the tree stores are checked, match_prefix skips the unmatched tail (faster)",
    )


class TreeNode:
    """One edge of the radix tree: ``key`` (token ids) and ``value`` (their KV slots).

    ``ck`` is the key under which the node sits in ``parent.children``.  A node
    whose ``value`` is None was evicted.
    """

    __slots__ = (
        "children",
        "parent",
        "key",
        "value",
        "ck",
        "lock_ref",
        "last_access_time",
        "creation_time",
        "hit_count",
        "priority",
        "id",
        "extra_key",
        "hash_value",
    )

    def __init__(self, key, value, parent, ck, now, priority=0, extra_key=None):
        self.children: dict = {}
        self.parent = parent
        self.key = key
        self.value = value
        self.ck = ck
        self.lock_ref = 0
        self.last_access_time = now
        self.creation_time = now
        self.hit_count = 0
        self.priority = priority
        self.id = next(_ids)
        self.extra_key = extra_key
        self.hash_value: Optional[list] = None

    @property
    def evicted(self) -> bool:
        return self.value is None

    def __lt__(self, other: "TreeNode") -> bool:
        return self.id < other.id

    def __repr__(self) -> str:
        ids = self.key if len(self.key) <= 6 else f"{self.key[:6]}...+{len(self.key) - 6}"
        return f"<radix node {self.id} len={len(self.key)} lock_ref={self.lock_ref} key={ids}>"


def _first_mismatch(a: list, off: int, b: list, n: int) -> int:
    """Length of the common prefix of ``a[off:off+n]`` and ``b[:n]`` (slice compares only)."""
    # Gallop (doubling windows) then bisect the window holding the divergence.
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
            return lo
        lo = hi
        step <<= 1
    return n


class RadixCache(BasePrefixCache):
    """SGLang-style radix tree cache; the class is its own ``create_cache`` factory."""

    # Tests may replace the clock on an instance (e.g. an itertools counter).
    clock = staticmethod(time.monotonic)

    def __init__(self, params: CacheInitParams):
        config = params.config
        self.config = config
        self.req_to_token_pool = params.req_to_token_pool
        self.token_to_kv_pool_allocator = params.token_to_kv_pool_allocator
        self.kv_pool = params.kv_pool
        self.page_size = int(params.page_size)
        alloc_ps = getattr(self.token_to_kv_pool_allocator, "page_size", self.page_size)
        if alloc_ps != self.page_size:
            raise ValueError(f"page_size={self.page_size} differs from the allocator's page_size={alloc_ps}")
        self.disable = bool(getattr(config, "disable", False))
        self.enable_kv_events = bool(getattr(config, "enable_kv_events", False))
        self.eviction_policy = str(getattr(config, "eviction_policy", "lru")).lower()
        self._check_match_tail = getattr(config, "key_validation", "full") != "stored"
        self.eviction_strategy = resolve_policy(self.eviction_policy)
        dev = getattr(self.token_to_kv_pool_allocator, "device", "cpu")
        self.device = torch.device(dev) if isinstance(dev, (str, torch.device)) else torch.device("cpu")
        self._events: list = []
        self._init_tree()

    # ------------------------------------------------------------------ state

    def _init_tree(self) -> None:
        root = TreeNode([], torch.empty((0,), dtype=torch.int64, device=self.device), None, None, self.clock(),
                        priority=-sys.maxsize)
        root.lock_ref = 1
        # (key, length, path, matched length) of the last match_prefix, for the insert after it.
        self._last_walk: tuple | None = None
        root.hash_value = []
        self.root_node = root
        self._evictable_size = 0
        self._protected_size = 0
        self._evictable_leaves: set[TreeNode] = set()
        self._empty_match = MatchResult(root.value, root, root)

    def reset(self) -> None:
        """Drop every cached entry and free its slots.  Refused while a node is locked."""
        if self._protected_size:
            raise RuntimeError(
                f"reset() while {self._protected_size} cached tokens are locked by running requests; "
                "finish them (or release their locks) first"
            )
        values = [owner.slots for owner in self.iter_owned_slots()]
        if values:
            self.token_to_kv_pool_allocator.free(torch.cat(values))
        self._init_tree()
        if self.enable_kv_events:
            self._events.append(AllPagesCleared())

    def evictable_size(self) -> int:
        return self._evictable_size

    def protected_size(self) -> int:
        return self._protected_size

    def total_size(self) -> int:
        total = 0
        stack = [self.root_node]
        while stack:
            node = stack.pop()
            total += len(node.key)
            stack.extend(node.children.values())
        return total

    def take_events(self) -> list:
        events, self._events = self._events, []
        return events

    def iter_owned_slots(self) -> Iterator[SlotOwner]:
        stack = list(self.root_node.children.values())
        while stack:
            node = stack.pop()
            yield SlotOwner("full", f"radix node {node.id}", node.value)
            stack.extend(node.children.values())

    def pretty_print(self, file=None) -> None:
        out = file or sys.stdout
        stack = [(self.root_node, 0)]
        while stack:
            node, indent = stack.pop()
            print(" " * indent, f"[{node.id}]", len(node.key), node.key[:10], f"r={node.lock_ref}", file=out)
            for child in node.children.values():
                stack.append((child, indent + 2))
        print(f"#tokens: {self.total_size()}", file=out)

    # ------------------------------------------------------------------ lookups

    def _descend(self, ids: list, n: int, extra) -> tuple:
        """Read-only walk: (full-match path, its length, node a match ends inside or None, tokens matched in it)."""
        ps = self.page_size
        ck = ids[0] if ps == 1 else tuple(ids[:ps])
        if extra is not None:
            ck = (extra, ck)
        children = self.root_node.children
        path = []
        pos = 0
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
            # The first page matched through the dict key, so m >= page_size here.
            m = _first_mismatch(ids, pos, ckey, min(len(ckey), n - pos))
            if ps > 1:
                m -= m % ps
            return path, pos, child, m

    def _walk(self, rk: RadixKey, n: int, check_tail: bool = True) -> tuple:
        """``_descend`` plus validation of every token the walk did not prove equal to a cached one.

        Cached keys hold only validated ids, so a token that compared equal to one
        is a valid id; the rest of the key is checked in one C pass before anything
        in the tree changes.
        """
        ids = rk.token_ids
        try:
            found = self._descend(ids, n, rk.extra_key)
        except TypeError:  # an unhashable element: report it the canonical way
            _validate(ids, 0)
            raise
        if check_tail and not rk.validated:
            _validate(ids, found[1] + found[3])
            # The walked part equals validated cached ids, the rest was just checked.
            rk.validated = True
        return found

    def match_prefix(self, key: KeyLike) -> MatchResult:
        rk = key if type(key) is RadixKey else as_radix_key(key, validate=False)
        ids = rk.token_ids
        n = len(ids)
        ps = self.page_size
        if ps > 1:
            n -= n % ps
        if self.disable or n == 0:
            if self._check_match_tail:
                _validate(ids, 0)
            return self._empty_match
        path, pos, split_child, m = self._walk(rk, n, self._check_match_tail)
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
        self._last_walk = (rk, n, path, pos)
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
        parent = child.parent
        key = child.key
        new = TreeNode(key[:m], child.value[:m], parent, child.ck, now, child.priority, child.extra_key)
        new.last_access_time = child.last_access_time
        new.lock_ref = child.lock_ref
        new.hit_count = child.hit_count
        rest = key[m:]
        child.key = rest
        child.value = child.value[m:]
        child.ck = rest[0] if self.page_size == 1 else tuple(rest[: self.page_size])
        child.parent = new
        new.children[child.ck] = child
        parent.children[new.ck] = new
        if child.hash_value is not None:
            pages = m // self.page_size
            new.hash_value, child.hash_value = child.hash_value[:pages], child.hash_value[pages:]
        return new

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
        ids = rk.token_ids
        n = len(ids)
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
        if self.disable or n == 0:
            _validate(ids, 0)
            return InsertResult(0, self.root_node)
        last = self._last_walk
        if last is not None and last[0] is rk and last[1] == n and rk.validated:
            path, pos, split_child, m = last[2], last[3], None, 0
        else:
            path, pos, split_child, m = self._walk(rk, n)
        self._last_walk = None
        # Nothing has changed so far; from here on the insert cannot fail.
        if priority is None:
            priority = 0
        hit = 0 if chunked else 1
        now = self.clock()
        node = self.root_node
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
        prefix_len = pos
        if pos < n:
            if value is None:
                v = torch.tensor(ids[pos:n], dtype=torch.int64, device=self.device)
            elif value.dtype is torch.int64:
                v = torch.narrow_copy(value, 0, pos, n - pos)  # one op: ~2x cheaper than slice + clone
            else:
                v = value[pos:n].to(torch.int64)
            if pos:
                ck = ids[pos] if ps == 1 else tuple(ids[pos : pos + ps])
            else:
                ck = ids[0] if ps == 1 else tuple(ids[:ps])
                if rk.extra_key is not None:
                    ck = (rk.extra_key, ck)
            leaf = TreeNode(ids[pos:n], v, node, ck, now, priority, rk.extra_key)
            leaf.hit_count = hit
            node.children[ck] = leaf
            self._evictable_size += n - pos
            leaves = self._evictable_leaves
            leaves.discard(node)
            leaves.add(leaf)
            if self.enable_kv_events:
                self._record_store(leaf)
            node = leaf
        return InsertResult(prefix_len, node)

    # ------------------------------------------------------------------ events

    def _record_store(self, leaf: TreeNode) -> None:
        parent = leaf.parent
        parent_hash = parent.hash_value[-1] if parent.hash_value else None
        leaf.hash_value = chain_page_hashes(leaf.key, self.page_size, parent_hash, leaf.extra_key)
        prev = parent_hash
        ps = self.page_size
        for i, h in enumerate(leaf.hash_value):
            self._events.append(PageStored(h, prev, tuple(leaf.key[i * ps : (i + 1) * ps]), leaf.extra_key))
            prev = h

    # ------------------------------------------------------------------ locks

    def _path(self, node: TreeNode, what: str) -> list:
        if not isinstance(node, TreeNode):
            raise TypeError(f"{what}: expected a radix TreeNode, got {type(node).__name__}")
        path = []
        root = self.root_node
        x = node
        while x is not root:
            if x is None or x.value is None:
                raise ValueError(f"{what}: {node!r} is not in this cache's tree (evicted, or from another cache)")
            path.append(x)
            x = x.parent
        return path

    def inc_lock_ref(self, node: TreeNode) -> LockResult:
        if self.disable:
            return LockResult(delta=0)
        path = self._path(node, "inc_lock_ref")
        delta = 0
        leaves = self._evictable_leaves
        for x in path:
            if x.lock_ref == 0:
                delta += len(x.key)
                leaves.discard(x)
            x.lock_ref += 1
        self._evictable_size -= delta
        self._protected_size += delta
        return LockResult(delta=delta)

    def dec_lock_ref(self, node: TreeNode, lock: LockResult | None = None) -> LockResult:
        if self.disable:
            return LockResult(delta=0)
        path = self._path(node, "dec_lock_ref")
        for x in path:
            if x.lock_ref <= 0:
                raise ValueError(
                    f"dec_lock_ref: {x!r} on the path of {node!r} is not locked; "
                    "was this lock already released?"
                )
        delta = 0
        leaves = self._evictable_leaves
        for x in path:
            x.lock_ref -= 1
            if x.lock_ref == 0:
                delta += len(x.key)
                if not x.children:
                    leaves.add(x)
        self._evictable_size += delta
        self._protected_size -= delta
        return LockResult(delta=-delta)

    # ------------------------------------------------------------------ eviction

    def evict(self, num_tokens: int) -> EvictResult:
        if self.disable or num_tokens <= 0 or not self._evictable_leaves:
            return EvictResult(0)
        get_priority = self.eviction_strategy.get_priority
        # Equal priorities go oldest node first, or newest first for policies that
        # evict the newest (mru, filo): SGLang's clock orders a new leaf after its split
        # sibling within one call, where ours reads the clock once.
        tie = -1 if getattr(self.eviction_strategy, "newest_first", False) else 1
        heap = [(get_priority(x), tie * x.id, x) for x in self._evictable_leaves]
        heapq.heapify(heap)
        self._last_walk = None
        leaves = self._evictable_leaves
        root = self.root_node
        events = self._events if self.enable_kv_events else None
        freed = []
        num = 0
        while num < num_tokens and heap:
            x = heapq.heappop(heap)[2]
            value = x.value
            freed.append(value)
            size = len(x.key)
            num += size
            parent = x.parent
            del parent.children[x.ck]
            leaves.discard(x)
            self._evictable_size -= size
            if events is not None and x.hash_value:
                events.extend(PageRemoved(h) for h in x.hash_value)
            x.value = None
            if parent is not root and parent.lock_ref == 0 and not parent.children:
                leaves.add(parent)
                heapq.heappush(heap, (get_priority(parent), tie * parent.id, parent))
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
        free_segment = getattr(alloc, "free_segment", None)
        if self.page_size == 1 or free_segment is None:
            alloc.free(freed[0] if len(freed) == 1 else torch.cat(freed))
        else:
            free_segment(freed[0] if len(freed) == 1 else torch.cat(freed[::-1]), start_pos=0)

    # ------------------------------------------------------------------ requests

    def cache_finished_req(self, req, is_insert: bool = True) -> None:
        kv = req.kv
        committed = kv.kv_committed_len
        protected = kv.cache_protected_len
        if self.disable:
            self.free_kv_row(kv, [(protected, committed)])
        elif not is_insert:
            # Two pieces, as SGLang frees them (paged, the tail's page ends up in front).
            aligned = floor_align(committed, self.page_size)
            self.free_kv_row(kv, [(protected, aligned), (aligned, committed)])
        else:
            aligned = floor_align(committed, self.page_size)
            row = self.req_to_token_pool.req_to_token[kv.req_pool_idx]
            token_ids = req.fill_ids[:aligned]
            values = row[:aligned].to(torch.int64)
            result = self.insert(RadixKey(token_ids, req.extra_key), values,
                                 priority=req.priority)
            # Duplicates of what the tree already held, then the unaligned tail.
            self.free_kv_row(kv, [(protected, result.prefix_len), (aligned, committed)])
        if req.last_node is not None:
            self.dec_lock_ref(req.last_node, req.lock)
        req.last_node = None
        req.lock = None

    def cache_unfinished_req(self, req, chunked: bool = False) -> None:
        if self.disable:
            return
        kv = req.kv
        committed = kv.kv_committed_len
        protected = kv.cache_protected_len
        aligned = floor_align(committed, self.page_size)
        row = self.req_to_token_pool.req_to_token[kv.req_pool_idx]
        key = RadixKey(req.fill_ids[:aligned], req.extra_key)
        values = row[:aligned].to(torch.int64)
        result = self.insert(key, values, priority=req.priority, chunked=chunked)
        self.free_kv_row(kv, [(protected, result.prefix_len)])

        match = self.match_prefix(key)
        new_indices, new_last_node = match.device_indices, match.last_device_node
        new_len = int(new_indices.shape[0])
        if new_len != aligned:
            raise AssertionError(f"request {req.rid!r}: re-match found {new_len} of {aligned} inserted tokens")
        if new_len > protected:
            row[protected:new_len] = new_indices[protected:].to(row.dtype)
        kv.cache_protected_len = new_len

        if req.last_node is not None:
            self.dec_lock_ref(req.last_node, req.lock)
        req.lock = self.inc_lock_ref(new_last_node)
        req.last_node = new_last_node
        if new_len < committed:
            req.prefix_indices = torch.cat([new_indices, row[new_len:committed].to(torch.int64)])
        else:
            req.prefix_indices = new_indices

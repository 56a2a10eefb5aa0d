"""UnifiedRadixCache: one radix tree, per-node values of pluggable components.

Behaviour follows SGLang 0.5.19's ``UnifiedRadixCache`` with its Python TreeCore
(written anew here, HiCache and sessions left out):

* Every node holds ``full`` slots; each other component holds a value or a tombstone
  (:mod:`kvcore.components` is the component contract).
* A match ends at the deepest node every component's validator accepts.
* Eviction: each component in order (full, then the others) runs its own walk until
  its target is met, on one shared tracker.  A leaf goes with every component it
  holds; dropping a component from an internal node also drops the components of
  lower priority there (Full 2 > SWA 1 > Mamba 0).  A leaf left with its full value
  alone (a *stateless* leaf) stays.
* Full eviction takes unlocked leaves (no component locks them) by recency.

The full-only set also answers as SGLang's ``RadixCache`` when its config says so
(``semantics = "radix"``: :class:`kvcore.tree.unified_config.RadixTreeConfig`, the
``radix`` backend): every eviction policy, one reading of the cache's ``clock`` per
call, an insert that leaves the caller's duplicates to it, ``key_validation``, and a
tree-only mode without an allocator.  Same nodes, walks, leaves and locks; only the
stamps, the insert's pool work and the request flows differ (the ``_radix_*`` methods).

Nodes, splits, path walks, LRU lists and KV events come from :mod:`kvcore.tree`.
"""

from __future__ import annotations

import itertools
import logging
import sys
import time
from collections.abc import Hashable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch

from kvcore.cache import BasePrefixCache, EvictResult, InsertResult, LockResult, MatchResult, SlotOwner
from kvcore.capabilities import Capability
from kvcore.components import TreeComponent, get_component
from kvcore.keys import KeyLike, RadixKey, as_radix_key, check_token_ids
from kvcore.pools import TokenToKVPoolAllocator
from kvcore.record import floor_align
from kvcore.release import free_swa_out_of_window_slots_batch
from kvcore.tree import (
    EvictOrder,
    KVEventLog,
    Node,
    ResumableInsert,
    alloc_value,
    check_evict_count,
    check_locked,
    check_request_ids,
    checked_value,
    child_key,
    descend,
    edge_match_len,
    iter_subtree,
    join_values,
    path_below,
    path_to_root,
    path_values,
    proven_prefix_len,
    record_removed,
    record_stored,
    resolve_policy,
    split_node,
    tree_lines,
)
from kvcore.tree.policies import LRUStrategy
from kvcore.tree.unified_config import RadixTreeConfig, UnifiedConfig

if TYPE_CHECKING:
    from collections.abc import Sequence

    from kvcore.config import CacheInitParams
    from kvcore.record import Req, ReqKvInfo

__all__ = ["UnifiedRadixCache", "UnifiedNode", "InsertArgs"]

_log = logging.getLogger(__name__)

# The dtypes a radix insert takes as slots (converted to int64).
_INT_DTYPES = frozenset({torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8})


class UnifiedNode(Node):
    """A tree node; components keep their per-node fields as attributes (``node_fields``)."""

    __slots__ = ("creation_time", "priority", "__dict__")
    split_copy = ("hit_count",)
    creation_time: float
    priority: int

    if TYPE_CHECKING:
        # The components' own fields (``TreeComponent.node_fields``): set on every new node.
        def __getattr__(self, name: str) -> Any: ...

        def __setattr__(self, name: str, value: Any) -> None: ...

    def __repr__(self) -> str:
        ids = self.key if len(self.key) <= 6 else f"{self.key[:6]}...+{len(self.key) - 6}"
        return f"<UnifiedNode {self.id} len={len(self.key)} lock_ref={self.lock_ref} key={ids}>"


@dataclass(slots=True)
class InsertArgs:
    """What one insert carries for the components (SGLang's InsertParams)."""

    prev_prefix_len: int = 0
    swa_evicted_seqlen: int = 0
    mamba_value: Any = None
    chunked: bool = False
    priority: int = 0
    # Filled in by the walk for the commit hooks.
    prefix_len: int = 0
    mamba_exist: bool = False
    # The mamba component took a fresh state slot itself (a direct insert without mamba_value).
    own_state: bool = False
    # The full-only walk already claimed the new leaf's slots (strict).
    claimed: bool = False
    # A request's row range holding the value's new slots was checked claimable already (the row's claim).
    row_checked: bool = False
    # The key's length before page alignment (a component whose value describes the key's end checks it).
    key_len: int = 0


class UnifiedRadixCache(KVEventLog, ResumableInsert, BasePrefixCache[UnifiedNode]):
    """SGLang's UnifiedRadixCache (or, full-only with ``semantics = "radix"``, its RadixCache); the class is its
    own ``create_cache`` factory."""

    # What the components need of it differs (the swa component's full/window pools): typed loosely.
    token_to_kv_pool_allocator: Any
    # RadixCache semantics read it once per call; tests may replace it on an instance (an itertools counter).
    clock = staticmethod(time.monotonic)

    def __init__(self, params: CacheInitParams):
        super().__init__(params)
        config = cast(UnifiedConfig, params.config)
        self.config = config
        alloc = self.token_to_kv_pool_allocator
        # SGLang RadixCache's answers (RadixTreeConfig) rather than its UnifiedRadixCache's.
        self.radix = config.semantics == "radix"
        # Tree-only (no allocator), as SGLang builds its RadixCache in its own unit tests: the values are the
        # caller's, so evict and reset only drop them, and the strict slot checks have no pool to check against.
        self.tree_only = alloc is None
        if self.tree_only:
            if not self.radix:
                raise ValueError("a tree without an allocator needs RadixCache semantics (the radix backend)")
            if self.strict:
                _log.info("radix: tree-only cache (no allocator): strict slot checks have nothing to check against")
            self.strict = False
        elif self.radix and alloc.page_size != self.page_size:
            raise ValueError(f"page_size={self.page_size} differs from the allocator's page_size={alloc.page_size}")
        self.device = torch.device("cpu" if alloc is None else alloc.device)
        self.disable = bool(config.disable)
        self.eviction_policy = str(config.eviction_policy).lower()
        self.enable_kv_events = bool(config.enable_kv_events)
        # What a split does to the node's place in each component's LRU (TreeComponent.on_split reads it).
        self.split_keeps_recency = config.split_recency == "keep"
        # key_validation="stored": match_prefix checks no id past the cached part.
        self._check_match_tail = not (isinstance(config, RadixTreeConfig) and config.key_validation == "stored")
        # RadixCache: every registered policy (equal priorities oldest node first, or newest first for the
        # policies that evict the newest: the strategy's newest_first).  UnifiedRadixCache: recency.
        self.eviction_strategy = resolve_policy(self.eviction_policy) if self.radix else LRUStrategy()
        # How iter_owned_slots names a node (the invariant checker's reports).
        self.node_label = "radix node" if self.radix else "tree node"
        names = tuple(config.components)
        comps: list[TreeComponent] = []
        for name in names:
            spec = get_component(name)
            opts = config.component_options(name)
            comps.append(spec.factory(self, opts))
        if not comps or comps[0].name != "full":
            raise ValueError(f"components={names!r}: the first component must be 'full'")
        if self.radix and len(comps) > 1:
            raise ValueError(f"RadixCache semantics are those of the full-only set, got components={names!r}")
        self.components: tuple[TreeComponent, ...] = tuple(comps)
        self.by_name = {c.name: c for c in comps}
        self.full: Any = comps[0]  # the full component (FullComponent: added(), ...)
        self.aux: tuple[TreeComponent, ...] = tuple(comps[1:])
        # What the set can do beyond the core calls: evictions are reported always; the rest is what the
        # components give it (swa: a window and its early lock release; mamba: per-request state).
        self.capabilities = frozenset({Capability.EVICTION_REPORTS}).union(*(c.capabilities for c in self.aux))
        # The component whose window free_window_slots frees, and the one whose lock dec_swa_lock_only gives back.
        self._window: Any = next((c for c in self.aux if Capability.WINDOWED in c.capabilities), None)
        self._window_lock: Any = next((c for c in self.aux if Capability.WINDOW_LOCK_RELEASE in c.capabilities), None)
        self._node_fields: dict[str, Any] = {}
        for c in self.aux:
            self._node_fields.update(c.node_fields)
        self._empty = torch.empty((0,), dtype=torch.int64, device=self.device)
        # A full-only tree on kvcore's own token allocator frees an insert's duplicates and claims its
        # new leaf in one call (TokenToKVPoolAllocator.free_and_claim); any other allocator: free, claim.
        self._run_pool = alloc if not self.aux and isinstance(alloc, TokenToKVPoolAllocator) else None
        self._events: list[Any] = []
        self._time = 0.0
        # While an eviction runs: the full slots it frees, given back in one call at its end.
        self.free_batch: list[torch.Tensor] | None = None
        # While an insert walk runs: the caller's duplicates found so far, with their row positions,
        # freed in walk order (SGLang's deferred FreeDeviceKV actions; see flush_duplicates).
        self.insert_dups: list[tuple[torch.Tensor, int]] | None = None
        for c in self.aux:
            # What the component adds to the cache's surface (swa: sliding_window_size,
            # swa_evictable_size(), ...; mamba: mamba_pool, ...).
            for attr, val in c.cache_attrs().items():
                setattr(self, attr, val)
        self._build_empty()

    # ------------------------------------------------------------------ state

    def tick(self) -> float:
        """SGLang's access-time counter: each call a new, larger time."""
        t = self._time
        self._time = t + 1.0
        return t

    def new_node(self, priority: int = 0, key: list[int] | None = None, value: Any = None,
                 parent: UnifiedNode | None = None, ck: Any = None, extra_key: str | None = None) -> UnifiedNode:
        """A node with SGLang's two ticks (access, then creation) and every component's fields."""
        node = UnifiedNode(key, value, parent, ck, extra_key)
        t = self._time
        node.last_access_time = t
        node.creation_time = t + 1.0
        self._time = t + 2.0
        node.priority = priority
        node.__dict__.update(self._node_fields)  # every component's fields at their initial values, in one call
        return node

    def radix_node(self, now: float, priority: int = 0, key: list[int] | None = None, value: Any = None,
                   parent: UnifiedNode | None = None, ck: Any = None, extra_key: str | None = None) -> UnifiedNode:
        """A node of RadixCache semantics: accessed and created ``now`` (the call's one clock reading)."""
        node = UnifiedNode(key, value, parent, ck, extra_key)
        node.last_access_time = now
        node.creation_time = now
        node.priority = priority
        return node

    def _build_empty(self) -> None:
        # The last full-only match walk, for the insert of the same key (None once the tree's shape changes).
        self._last_walk: tuple | None = None
        if self.radix:
            root = self.radix_node(self.clock(), -sys.maxsize)
            root.lock_ref = 1  # as RadixCache's root: never evictable, and a request holding it reads one lock
        else:
            root = self.new_node()
        root.value = self._empty
        root.hash_value = []
        self.root_node = root
        # SGLang's D-leaves (unlocked, childless) in eviction order: least recently used first (the full
        # component's order), or the policy's under RadixCache semantics.
        self.leaves = EvictOrder(self.eviction_strategy)
        for c in self.components:
            c.reset_state()
        if self.radix:
            self._empty_match = MatchResult(self._empty, root, root)
        else:
            self._empty_match = MatchResult(self._empty, root, root, 0, {"matched_len": 0})

    def reset(self) -> None:
        """Free every node's slots and start from an empty tree (call it only when no request runs)."""
        if self.radix:
            self._radix_reset()
            return
        nodes = list(iter_subtree(self.root_node))
        for node in nodes:
            for c in reversed(self.components):
                if c.has_value(node):
                    c.free_value(node)
        for node in nodes:
            node.parent = None
        self._build_empty()
        self.record_cleared()

    # ------------------------------------------------------------------ sizes

    def evictable_size(self) -> int:
        return self.full.evictable_size()

    def protected_size(self) -> int:
        return self.full.protected_size()

    def total_size(self) -> int:
        return self.full.evictable_size() + self.full.protected_size()

    def full_evictable_size(self) -> int:
        return self.full.evictable_size()

    def full_protected_size(self) -> int:
        return self.full.protected_size()

    def request_state_slots(self, kv: ReqKvInfo) -> int:
        return sum(c.request_state_slots(kv) for c in self.aux)

    def backup_request_state(self, req: Req) -> Any:
        """Each component's copy of what ``req`` holds beside its token slots (by name), or None."""
        saved = {c.name: st for c in self.aux if (st := c.backup_request_state(req)) is not None}
        return saved or None

    def restore_request_state(self, req: Req, state: Any) -> None:
        for c in self.aux:
            if c.name in state:
                c.restore_request_state(req, state[c.name])

    def stats(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for c in self.aux:
            out.update(c.stats())
        return out

    def cached_sizes(self) -> dict[str, tuple[int, int]]:
        if not self.aux:
            return {"full": (self.evictable_size(), self.protected_size())}
        return {c.pool: (c.evictable_size(), c.protected_size()) for c in self.components}

    def pools(self) -> list:
        if self.tree_only:
            return []  # no pool: the invariant checker has no slot to prove
        views = list(self.token_to_kv_pool_allocator.pool_views())
        for c in self.aux:
            views.extend(c.pool_views())
        return views

    # ------------------------------------------------------------------ leaves

    def is_leaf(self, node: UnifiedNode) -> bool:
        """SGLang's D-leaf: not root, no component lock, no child."""
        if node is self.root_node or node.lock_ref > 0 or node.children:
            return False
        for c in self.aux:
            if c.lock_ref(node) > 0:
                return False
        return True

    def update_leaf(self, node: UnifiedNode) -> None:
        if self.is_leaf(node):
            self.leaves.add(node)
        else:
            self.leaves.discard(node)

    # ------------------------------------------------------------------ split

    def split(self, child: UnifiedNode, k: int) -> UnifiedNode:
        """Cut ``child`` after ``k`` tokens; returns the new upper node (``child`` keeps the rest)."""
        self._last_walk = None
        up = self.new_node(child.priority)
        ps = self.page_size
        split_node(child, k, up, ps)
        up.creation_time = child.creation_time
        up.lock_ref = child.lock_ref
        for c in self.aux:
            c.on_split(up, child)
        child.last_access_time = self.tick()
        self.update_leaf(up)
        self.update_leaf(child)
        return up

    # ------------------------------------------------------------------ match

    def match_prefix(self, key: KeyLike, cow_mamba: bool = False, req: Req | None = None) -> MatchResult:
        """The longest cached prefix every component accepts (SGLang's ``match_prefix``)."""
        rk = key if type(key) is RadixKey else as_radix_key(key, validate=False)
        ids = rk.token_ids
        n = floor_align(len(ids), self.page_size)
        root = self.root_node
        if self.disable or n == 0:
            if self.radix:
                if self._check_match_tail:
                    check_token_ids(ids)
                return self._empty_match
            self._validate(rk, 0)
            return self._finish_match(self._empty_match, cow_mamba, req)
        aux = self.aux
        if not aux:
            return self._radix_match(rk, ids, n) if self.radix else self._match_full(rk, ids, n)
        validators = [c.validator() for c in aux]
        node = root
        pos = 0
        values: list[torch.Tensor] = []
        best = root
        best_items = 0
        best_len = 0
        extra = rk.extra_key
        ps = self.page_size
        children = root.children
        while pos < n:
            try:
                child = children.get(child_key(ids, pos, ps, extra if pos == 0 else None))
            except TypeError:  # an unhashable element: report it the canonical way
                check_token_ids(ids)
                raise
            if child is None:
                break
            plen = edge_match_len(ids, pos, child.key, n, ps)
            inside = plen < len(child.key)
            if inside:
                # Ids that compared equal to cached (valid) ones are valid; check the rest first.
                self._validate(rk, pos + plen)
                child = self.split(child, plen)
            values.append(child.value)
            pos += plen
            node = child
            if not validators or all([v(node) for v in validators]):
                best, best_items, best_len = node, len(values), pos
            if inside:
                break
            children = node.children
        self._validate(rk, pos)
        for c in aux:
            c.after_match(best)
        self._stamp_path(best)
        indices = join_values(values[:best_items], self._empty)
        result = MatchResult(indices, best, best, best_len, {"matched_len": pos})
        return self._finish_match(result, cow_mamba, req)

    def _match_full(self, rk: RadixKey, ids: list[int], n: int) -> MatchResult:
        """``match_prefix`` of a full-only tree: every node is a valid end, so the deepest one wins."""
        path, pos, split_child, m = descend(self.root_node, ids, n, self.page_size, rk.extra_key)
        no01 = False
        if not rk.validated:
            no01 = check_token_ids(ids, pos + m, refuse_bools=self.strict)
            rk.validated = True
        if split_child is not None:
            path.append(self.split(split_child, m))
            pos += m
        # An engine inserts the key it just matched: the insert reuses this walk while the shape holds.
        self._last_walk = (rk, n, path, pos, no01)
        if not path:
            t = self.tick()
            self.root_node.last_access_time = t
            return MatchResult(self._empty, self.root_node, self.root_node, 0, {"matched_len": 0})
        best = path[-1]
        self._stamp_path(best)
        indices = best.value if len(path) == 1 else torch.cat([x.value for x in path])
        return MatchResult(indices, best, best, pos, {"matched_len": pos})

    def _radix_match(self, rk: RadixKey, ids: list[int], n: int) -> MatchResult:
        """``match_prefix`` under RadixCache semantics: the root and the path stamped with one clock reading."""
        path, pos, split_child, m = descend(self.root_node, ids, n, self.page_size, rk.extra_key)
        no01 = False
        if self._check_match_tail and not rk.validated:
            # The walked part equals validated cached ids; the rest is checked before anything changes.
            no01 = check_token_ids(ids, pos + m, refuse_bools=self.strict)
            rk.validated = True
        now = self.clock()
        self.root_node.last_access_time = now
        for x in path:
            x.last_access_time = now
        if split_child is not None:
            split_child.last_access_time = now
            path.append(self._radix_split(split_child, m, now))
            pos += m
        # An engine inserts the key it just matched: the insert reuses this walk while the shape holds.
        self._last_walk = (rk, n, path, pos, no01)
        if not path:
            return self._empty_match
        node = path[-1]
        value = node.value if len(path) == 1 else torch.cat([x.value for x in path])
        return MatchResult(value, node, node)

    def _radix_split(self, child: UnifiedNode, m: int, now: float) -> UnifiedNode:
        """``split`` under RadixCache semantics: the new upper half is created ``now``, with the lower half's
        access time, hit count, priority and lock (its leaf state does not change: it has a child)."""
        self._last_walk = None
        up = split_node(child, m, UnifiedNode(), self.page_size)
        up.last_access_time = child.last_access_time
        up.creation_time = now
        up.priority = child.priority
        up.lock_ref = child.lock_ref
        return up

    def _stamp_path(self, node: UnifiedNode) -> None:
        """SGLang's match touch: one new time on ``node``, a hair older on each ancestor up to the root."""
        t = self.tick()
        x: Any = node
        while x is not None:
            x.last_access_time = t
            t -= 0.00001
            x = x.parent

    def _validate(self, rk: RadixKey, start: int) -> None:
        """Check the ids of ``rk`` from ``start`` on (the ones before compared equal to cached ids)."""
        if not rk.validated:
            check_token_ids(rk.token_ids, start, refuse_bools=self.strict)
            rk.validated = True

    def _matched_len(self, ids: list, n: int, extra_key: str | None) -> int:
        """How many of ``ids[:n]`` the tree holds (to validate only the rest)."""
        try:
            _, pos, _, m = descend(self.root_node, ids, n, self.page_size, extra_key)
        except TypeError:
            return 0
        return pos + m

    def _finish_match(self, result: MatchResult, cow_mamba: bool, req: Req | None) -> MatchResult:
        for c in self.aux:
            result = c.finish_match(result, cow_mamba, req)
        return result

    def match_request(self, req: Req, key: KeyLike) -> MatchResult:
        """The engine's admission match: a plain match; components note what the request takes (Mamba's copy)."""
        result = self.match_prefix(key)
        for c in self.aux:
            c.on_match_request(req, result)
        return result

    # ------------------------------------------------------------------ insert

    def insert(self, key: KeyLike, value: torch.Tensor | None = None, prev_prefix_len: int = 0,
               swa_evicted_seqlen: int = 0, *, mamba_value: torch.Tensor | None = None, chunked: bool = False,
               priority: int = 0) -> InsertResult:
        """Cache ``value`` (full slots) under ``key``; returns the length that was cached already.

        As SGLang's unified tree, the insert frees the caller's duplicates itself:
        positions ``[prev_prefix_len, prefix_len)`` of ``value`` that the tree already
        held (``InsertResult.duplicates_freed``).  ``swa_evicted_seqlen``: the window
        slots below it are gone (stored as window tombstones); ``mamba_value``: the
        state slot to keep on the last node.  ``value=None`` allocates fresh slots.
        """
        rk = key if type(key) is RadixKey else as_radix_key(key, validate=False)
        if self.radix:
            if prev_prefix_len or swa_evicted_seqlen or mamba_value is not None:
                raise TypeError("insert: RadixCache semantics leave the caller's duplicates to the caller and keep "
                                "no window or state: prev_prefix_len, swa_evicted_seqlen and mamba_value are not taken")
            return self._radix_insert_key(rk, value, priority, chunked)
        ids = rk.token_ids
        ps = self.page_size
        n = floor_align(len(ids), ps)
        if not rk.validated and (self.aux or self.disable or n == 0 or value is None):
            self._validate(rk, self._matched_len(ids, n, rk.extra_key))
        if not (type(prev_prefix_len) is int and type(swa_evicted_seqlen) is int and prev_prefix_len >= 0
                and swa_evicted_seqlen >= 0 and not prev_prefix_len % ps and not swa_evicted_seqlen % ps):
            for name, v in (("prev_prefix_len", prev_prefix_len), ("swa_evicted_seqlen", swa_evicted_seqlen)):
                if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                    raise ValueError(f"{name} must be a non-negative int, got {v!r}")
                if v % ps:
                    raise ValueError(f"{name}={v} must be a multiple of page_size={ps}")
        if prev_prefix_len > n:
            raise ValueError(f"prev_prefix_len={prev_prefix_len} is longer than the page-aligned key ({n} tokens)")
        if value is None:
            if self.disable or n == 0:
                return InsertResult(0, self.root_node, duplicates_freed=True)
            value = alloc_value(self.token_to_kv_pool_allocator, n)
            prev_prefix_len = swa_evicted_seqlen = 0
        elif not (type(value) is torch.Tensor and value.dtype is torch.int64 and value.dim() == 1
                  and value.device == self.device and n <= value.shape[0] <= len(ids)):
            value = checked_value(value, len(ids), n, self.device)
        if self.disable or n == 0:
            return InsertResult(0, self.root_node, duplicates_freed=True)
        if value.shape[0] != n:
            value = value[:n]
        ins = InsertArgs(prev_prefix_len, swa_evicted_seqlen, mamba_value, chunked, priority, key_len=len(ids))
        if not self.aux:
            prefix_len, last = self._insert_full(ids, rk.extra_key, n, value, ins, rk)
            return InsertResult(prefix_len, last, True, False)
        for c in self.aux:
            c.check_insert(n, ins)
        if self.strict and self.aux:
            # (A full-only tree checks only the new leaf's slots, once the walk has found them.)
            # prev_prefix_len never narrows the check: only the tree's own slots skip it.
            lo = proven_prefix_len(self.root_node, ids, n, ps, rk.extra_key, value, prev_prefix_len) \
                if prev_prefix_len else 0
            self.token_to_kv_pool_allocator.check_claimable(value[lo:n])
        for c in self.aux:
            c.before_insert(value, ins)
        prefix_len, last = self._insert(ids, rk.extra_key, n, value, ins, rk)
        return InsertResult(prefix_len, last, True, ins.mamba_exist)

    # -- the insert under RadixCache semantics (the caller frees its duplicates) --

    def _radix_insert_key(self, rk: RadixKey, value: torch.Tensor | None, priority: int,
                          chunked: bool) -> InsertResult:
        """Insert ``rk`` -> ``value`` (KV slots); returns the length that was already cached.

        Only whole pages are inserted.  Slots of the already-cached part are *not* freed
        here (the caller frees its duplicates).  ``value=None`` uses the token ids as
        values (SGLang's simulation mode: do not evict such entries into a real
        allocator).  ``priority`` feeds the ``priority`` policy; ``chunked`` skips hit
        counting (a chunked prefill re-inserting its own prefix).
        """
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
        return self._radix_insert(rk, n, value, priority, chunked, False)

    def _radix_insert(self, rk: RadixKey, n: int, value: torch.Tensor | None, priority: int | None,
                      chunked: bool, row_checked: bool) -> InsertResult:
        """The insert of ``rk``'s first ``n`` (page-aligned) tokens; ``row_checked``: a request's row range
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
            path, pos, split_child, m = descend(self.root_node, ids, n, self.page_size, rk.extra_key)
            if not rk.validated:
                check_token_ids(ids, pos + m, refuse_bools=self.strict)
                rk.validated = True
        self._last_walk = None
        v = self._radix_leaf_value(ids, value, pos + m, n, row_checked)
        # Nothing has changed so far; from here on the insert cannot fail.
        return self._radix_commit(path, split_child, m, ids, pos, n, v, priority, chunked, rk.extra_key)

    def _radix_leaf_value(self, ids: list[int], value: torch.Tensor | None, start: int, n: int,
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
                self.token_to_kv_pool_allocator.claim(v, checked=False)
            else:
                # Refused (nothing changed) unless every new slot may become this tree's own.
                self.token_to_kv_pool_allocator.check_claimable(v, commit=True)
        return v

    def _radix_commit(self, path: list, split_child: UnifiedNode | None, m: int, ids: list[int], pos: int, n: int,
                      v: torch.Tensor | None, priority: int | None, chunked: bool, extra_key: str | None,
                      base: int = 0) -> InsertResult:
        """The insert's changes once its walk is known: ``path`` (root side first) touched, the split, the new leaf,
        all with one clock reading.  ``ids[pos:n]`` are the key's tokens past ``path`` (``base`` tokens in front
        of ``ids[0]``: a resumed insert's ids start below its locked node)."""
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
            node = self._radix_split(split_child, m, now)
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
            leaf = self.radix_node(now, priority, ids[pos:n], v, node, ck, extra_key)
            leaf.hit_count = hit
            node.children[ck] = leaf
            self.full.added(leaf)
            leaves = self.leaves
            leaves.discard(node)
            leaves.add(leaf)
            if self.enable_kv_events:
                record_stored(self._events, leaf, ps)
            node = leaf
        return InsertResult(prefix_len, node)

    def _insert(self, ids: list[int], extra_key: str | None, n: int, value: torch.Tensor,
                ins: InsertArgs, rk: RadixKey | None = None,
                resumed: tuple[list[UnifiedNode], torch.Tensor] | None = None) -> tuple[int, UnifiedNode]:
        """Insert ``ids[:n]`` -> ``value`` (SGLang's insert walk with every component's part).

        ``resumed``: a running request's ``(locked path, row)``; ``ids``, ``n`` and ``value`` then start
        where that path ends (``base`` tokens from the root): the walk passes the path's nodes as it
        would (:meth:`_pass_locked`) without comparing their tokens.  Returns the cached length from the
        root and the node the key ends on.
        """
        aux = self.aux
        if not aux:
            return self._insert_full(ids, extra_key, n, value, ins, rk)
        root = self.root_node
        root.last_access_time = self.tick()
        if ins.priority > root.priority:
            root.priority = ins.priority
        dups: list[tuple[torch.Tensor, int]] = []
        self.insert_dups = dups
        base = 0
        node = root
        try:
            if resumed is not None:
                base, node = self._pass_locked(resumed[0], resumed[1], ins)
            pos, node = self._insert_walk(ids, extra_key, n, value, ins, node, dups, base)
            self.flush_duplicates()
        finally:
            self.insert_dups = None
        ins.prefix_len = base + pos
        new_leaf = pos < n
        if new_leaf:
            node = self.add_leaf(node, ids[pos:n], extra_key, value[pos:n], ins.priority, claimed=ins.claimed)
        for c in aux:
            c.on_insert_commit(node, new_leaf, ins)
        if node is not root:
            for c in aux:
                c.after_insert(node)
        return base + pos, node

    def _pass_locked(self, upper: list[UnifiedNode], row: torch.Tensor, ins: InsertArgs) -> tuple[int, UnifiedNode]:
        """The insert walk over a running request's locked path, as :meth:`_insert_walk` passes it.

        Every node lies below ``ins.prev_prefix_len`` (the request's protected length), so the
        walk finds no duplicates there; each node is touched, its priority and hits raised and
        each component told of the overlap, with the row's slots (which are the node's).
        """
        aux = self.aux
        hit = 0 if ins.chunked else 1
        prio = ins.priority
        pos = 0
        node = self.root_node
        for node in upper:
            node.last_access_time = self.tick()
            for c in aux:
                c.touch(node)
            plen = len(node.key)
            if prio > node.priority:
                node.priority = prio
            value_slice = row[pos : pos + plen]
            for c in aux:
                c.on_insert_overlap(node, plen, pos, value_slice, ins)
            node.hit_count += hit
            pos += plen
        return pos, node

    def _insert_walk(self, ids: list[int], extra_key: str | None, n: int, value: torch.Tensor, ins: InsertArgs,
                     node: UnifiedNode, dups: list[tuple[torch.Tensor, int]], base: int = 0
                     ) -> tuple[int, UnifiedNode]:
        """The general insert's walk down the cached part from ``node`` (``base`` tokens from the root, where
        ``ids[0]`` sits); the caller's duplicates go to ``dups`` with their row positions."""
        aux = self.aux
        ps = self.page_size
        pos = 0
        prev = ins.prev_prefix_len - base
        while pos < n:
            child = node.children.get(child_key(ids, pos, ps, extra_key if pos + base == 0 else None))
            if child is None:
                break
            child.last_access_time = self.tick()
            for c in aux:
                c.touch(child)
            plen = edge_match_len(ids, pos, child.key, n, ps)
            if plen < len(child.key):
                child = self.split(child, plen)
            if ins.priority > child.priority:
                child.priority = ins.priority
            value_slice = value[pos : pos + plen]
            consumed = plen
            for c in aux:
                got = c.on_insert_overlap(child, plen, base + pos, value_slice, ins)
                if got < consumed:
                    consumed = got
            dup_start = prev - pos if prev > pos else 0
            if dup_start < consumed:
                dups.append((value_slice[dup_start:consumed], base + pos + dup_start))
            if not ins.chunked:
                child.hit_count += 1
            node = child
            pos += plen
        return pos, node

    def flush_duplicates(self) -> None:
        """Free the running insert walk's duplicates found so far (none: nothing to do).

        SGLang defers them as actions in walk order and frees them before the full
        slots a later node of the walk gives back (a healed tombstone's), so
        :meth:`replace_full` and a locked recovery call this before their own frees.
        """
        dups = self.insert_dups
        if dups:
            self._free_pieces(dups)
            dups.clear()

    def _free_pieces(self, pieces: list[tuple[torch.Tensor, int]]) -> None:
        """Free the caller's row pieces ``(slots, row position)``, root first, as SGLang frees them node by node.

        At page 1 a free appends its slots, so one free of the concatenation leaves the
        same order; with pages each free puts its pages at the front of the free list, so
        there it is one piece per node, in one ``free_segments`` call (each piece freed as one
        ``free_segment``; checked as a whole: on a bad slot nothing is freed).
        """
        alloc = self.token_to_kv_pool_allocator
        if self.page_size == 1:
            alloc.free(pieces[0][0] if len(pieces) == 1 else torch.cat([p for p, _ in pieces]))
            return
        alloc.free_segments(pieces)

    def _insert_full(self, ids: list[int], extra_key: str | None, n: int, value: torch.Tensor,
                     ins: InsertArgs, rk: RadixKey | None, upper: list[UnifiedNode] | None = None
                     ) -> tuple[int, UnifiedNode]:
        """``_insert`` of a full-only tree (what most engines run): no per-node component calls.

        Nothing consumes the caller's slots, so its duplicates are one range, freed in one call.
        ``upper``: a resumed insert's locked path (root side first); ``ids`` then start below it.
        The clock reads as the general walk's: one tick for the root, one per node passed,
        two for a new leaf (access, creation).
        """
        root = self.root_node
        t = self._time
        root.last_access_time = t
        self._time = t + 1.0
        if ins.priority > root.priority:
            root.priority = ins.priority
        pos, node, ids, leaf_value = self._walk_full(ids, extra_key, n, ins, rk, value, upper)
        ins.prefix_len = pos
        if leaf_value is not None:
            node = self.add_leaf(node, ids[pos:n], extra_key, leaf_value, ins.priority, ins.claimed, own=True)
        return pos, node

    def _reuse_walk(self, rk: RadixKey, n: int) -> tuple | None:
        """The last full-only ``match_prefix`` walk when ``rk`` holds the same first ``n`` ids (and namespace).

        Any change of the tree's shape (split, new leaf, deleted leaf, reset) clears it, so
        its path still holds.  Returns ``(path, pos, ids)`` or None; ``ids`` are the matched
        key's own, already checked, when ``rk``'s are not checked but that key's checked rest
        held no 0 or 1 (a token equal to a checked id is taken as that id, as on the walked
        path); else ``rk``'s, whose rest is checked here.
        """
        last = self._last_walk
        if last is None or last[1] != n:
            return None
        lrk, _, path, pos, no01 = last
        if lrk is not rk:
            if rk.extra_key != lrk.extra_key or not rk.same_prefix(lrk, n):
                return None
            if lrk.validated and (rk.validated or (no01 and len(rk) == n)):
                # (Only a key of whole pages: an unaligned tail of rk's own is checked below.)
                return path, pos, lrk.token_ids
        ids = rk.token_ids
        if not rk.validated:
            check_token_ids(ids, pos, refuse_bools=self.strict)
            rk.validated = True
        return path, pos, ids

    def _walk_full(self, ids: list[int], extra_key: str | None, n: int, ins: InsertArgs,
                   rk: RadixKey | None, value: torch.Tensor, upper: list[UnifiedNode] | None = None
                   ) -> tuple[int, UnifiedNode, list[int], torch.Tensor | None]:
        """The insert walk of a full-only tree: touch, split, priority and hits, as the general walk does.

        The last match's walk when it was of the same key (:meth:`_reuse_walk`), else a
        read-only descent first, so that ``rk``'s unchecked ids (those past the cached part)
        are validated before anything changes; then the pool's part (the caller's duplicates
        freed, the new leaf's slots claimed under strict: ``ins.claimed``), refused with nothing
        changed.  Returns the cached length, the node it ends on, the ids to store and the new
        leaf's own copy of its slots (None: nothing new).  With ``upper`` (a resumed insert: its
        locked path, root side first) the descent starts below it and the walk passes ``upper`` first.
        """
        reused = self._reuse_walk(rk, n) if rk is not None and upper is None else None
        if upper is not None:
            path, pos, split_child, m = descend(upper[-1], ids, n, self.page_size)
            path = upper + path
        elif reused is not None:
            path, pos, ids = reused
            split_child, m = None, 0
        else:
            path, pos, split_child, m = descend(self.root_node, ids, n, self.page_size, extra_key)
            if rk is not None:
                self._validate(rk, pos + m)
        self._last_walk = None
        start = pos + m
        leaf_value = None
        # The pool's part, before anything here changes: the caller's duplicates ``[prev, start)``
        # freed, the new leaf's slots claimed (strict), or the insert refused with nothing changed.
        prev = ins.prev_prefix_len
        lo = prev if prev < start else start
        cuts = self._duplicate_cuts(path, m, prev, start) if self.page_size > 1 and prev < start else ()
        pool = self._run_pool
        # (Non-strict with nothing to free, the pool has nothing to do: no call.)
        own = pool.free_and_claim(value, lo, start, n, cuts, claim=self.strict) \
            if pool is not None and lo < n and (lo < start or self.strict) else None
        if own is not None:
            # The usual value (one run of slots, none free, none the tree's): one pool call, which
            # also made the new leaf's own copy of its slots.
            ins.claimed = True
            if start < n:
                leaf_value = own
        else:
            if start < n:
                # The new leaf's own copy (one op: cheaper than slice + clone), checked as radix checks it.
                leaf_value = torch.narrow_copy(value, 0, start, n - start)
            alloc = self.token_to_kv_pool_allocator
            claim = leaf_value is not None and self.strict and not ins.row_checked
            if claim:
                # Refused (nothing changed) unless the new leaf's slots may become the tree's; claimed here.
                alloc.check_claimable(leaf_value, commit=True)
                ins.claimed = True
            if prev < start:
                try:
                    self._free_duplicates(value, prev, start, cuts)
                except BaseException:
                    if claim:
                        alloc.disown(leaf_value)  # a refused free (e.g. the tree's own slots): undo the claim
                    raise
        prio = ins.priority
        hit = 0 if ins.chunked else 1
        t = self._time
        node = self.root_node
        for node in path:
            node.last_access_time = t
            t += 1.0
            if prio > node.priority:
                node.priority = prio
            node.hit_count += hit
        self._time = t
        if split_child is not None:
            split_child.last_access_time = self.tick()
            node = self.split(split_child, m)
            if prio > node.priority:
                node.priority = prio
            node.hit_count += hit
            pos += m
        return pos, node, ids, leaf_value

    @staticmethod
    def _duplicate_cuts(path: list[UnifiedNode], m: int, prev: int, start: int) -> list[int]:
        """Where the duplicates ``[prev, start)`` end node by node, root side first: the ends of the
        path's nodes (``m``: the tokens of the node a split is about to cut off ``path``'s end)."""
        cuts = []
        end = start
        if m:
            cuts.append(end)
            end -= m
        i = len(path) - 1
        while end > prev:
            cuts.append(end)
            end -= len(path[i].key)
            i -= 1
        cuts.reverse()
        return cuts

    def _free_duplicates(self, value: torch.Tensor, prev: int, start: int, cuts: Sequence[int]) -> None:
        """Free the caller's copies ``value[prev:start]`` of what the tree's path holds, in one call
        (checked as a whole: refused, nothing freed, on a bad slot).

        Under strict the allocator refuses a node's own slots given back as "duplicates" (use
        after free).  SGLang frees them node by node, root first (``free_segment``): one piece per
        node, ending at each of ``cuts`` (:meth:`_free_pieces`).
        """
        if self.page_size == 1:
            self.token_to_kv_pool_allocator.free(value[prev:start])
            return
        pieces = []
        lo = prev
        for end in cuts:
            pieces.append((value[lo:end], lo))
            lo = end
        self._free_pieces(pieces)

    def add_leaf(self, parent: UnifiedNode, key: list[int], extra_key: str | None, value: torch.Tensor,
                 priority: int = 0, claimed: bool = False, own: bool = False) -> UnifiedNode:
        """A new leaf under ``parent``; ``own``: ``value`` is the caller's fresh copy, kept as is."""
        self._last_walk = None
        ps = self.page_size
        ck = child_key(key, 0, ps, extra_key if parent is self.root_node else None)
        node = self.new_node(priority, key, value if own else value.clone(), parent, ck, extra_key)
        if self.strict and not claimed:
            self.token_to_kv_pool_allocator.claim(node.value, checked=False)
        parent.children[ck] = node
        self.full.added(node)
        leaves = self.leaves
        if self.aux:
            self.update_leaf(node)
        else:
            leaves.add(node)  # full-only: a new, unlocked node without children is a leaf
        leaves.discard(parent)  # it has a child now
        if self.enable_kv_events:
            record_stored(self._events, node, ps)
        return node

    def replace_full(self, node: UnifiedNode, new: torch.Tensor, *, free_old: str = "full") -> None:
        """Give ``node`` the caller's full slots ``new`` in place of its own (same tokens)."""
        alloc = self.token_to_kv_pool_allocator
        old = node.value
        if self.strict:
            alloc.disown(old)
            alloc.claim(new, checked=False)
        node.value = new.clone()
        self.flush_duplicates()
        if free_old == "full":
            alloc.free_full(old)
        else:
            alloc.free(old)

    # ------------------------------------------------------------------ locks

    def _path(self, node: Any, what: str) -> list[UnifiedNode]:
        if not isinstance(node, UnifiedNode):
            raise TypeError(f"{what}: expected a node of this cache, got {type(node).__name__}")
        return path_to_root(node, self.root_node, what)

    def inc_lock_ref(self, node: UnifiedNode) -> LockResult:
        """Lock ``node`` for a request: each component takes its share (full: the path to the root)."""
        if self.radix:
            # RadixCache: a node of this tree (TypeError otherwise, None included); the root locks nothing.
            if self.disable:
                return LockResult(delta=0)
            return LockResult(delta=self.full.lock_path(self._path(node, "inc_lock_ref"), []))
        lock = LockResult(0, None, {})
        if node is None or self.disable or node is self.root_node:
            return lock
        path = self._path(node, "inc_lock_ref")
        if not self.aux:
            newly: list[UnifiedNode] = []
            lock.delta = self.full.lock_path(path, newly)
            return lock
        before = [c.protected_size() for c in self.aux]
        for c in self.components:
            c.lock(node, lock)
        for c, b in zip(self.aux, before):
            lock.extras[f"{c.name}_delta"] = c.protected_size() - b
        self.update_leaf(node)
        return lock

    def dec_lock_ref(self, node: UnifiedNode, lock: LockResult | None = None) -> LockResult:
        """Give back what ``inc_lock_ref(node)`` returned as ``lock``."""
        if self.radix:
            if self.disable:
                return LockResult(delta=0)
            path = self._path(node, "dec_lock_ref")
            check_locked(path, node, "dec_lock_ref")
            if lock is not None:
                lock.check_not_released("dec_lock_ref", node)
                lock.released = True
            return LockResult(delta=-self.full.unlock_path(path))
        if lock is not None:
            lock.check_not_released("dec_lock_ref", node)
        if node is None or self.disable or node is self.root_node:
            if lock is not None:
                lock.released = True
            return LockResult(0)
        path = self._path(node, "dec_lock_ref")
        check_locked(path, node, "dec_lock_ref")
        if not self.aux:
            delta = self.full.unlock_path(path)
            if lock is not None:
                lock.released = True
            return LockResult(-delta)
        before = [c.protected_size() for c in self.components]
        early = lock.released_early if lock is not None else ()
        for c in self.components:
            # dec_swa_lock_only gave back the window lock and the lower-priority ones already.
            if c.name in early:
                continue
            c.unlock(node, lock)
        self.update_leaf(node)
        if lock is not None:
            lock.released = True
        deltas = [c.protected_size() - b for c, b in zip(self.components, before)]
        return LockResult(deltas[0], None, {f"{c.name}_delta": d for c, d in zip(self.aux, deltas[1:])})

    def dec_swa_lock_only(self, node: UnifiedNode, lock: LockResult | None = None) -> LockResult:
        """Release the window part of ``lock`` early (and the lower-priority locks on ``node``)."""
        if node is None or self.disable or node is self.root_node:
            return LockResult(0)
        swa = self._window_lock
        if swa is None:
            self._path(node, "dec_swa_lock_only")
            raise NotImplementedError(
                f"dec_swa_lock_only: {node!r} holds no window lock to give back: components "
                f"{tuple(c.name for c in self.components)!r} have no swa component; check "
                "Capability.WINDOW_LOCK_RELEASE in cache.capabilities first (nothing was changed)"
            )
        self._path(node, "dec_swa_lock_only")
        if lock is not None:
            lock.check_not_released("dec_swa_lock_only", node)
            if swa.name in lock.released_early:
                raise ValueError(f"dec_swa_lock_only: the window lock on {node!r} was already given back")
        took = lock.extras.get("swa_tokens") if lock is not None else None
        if took == 0:
            # The lock took no window lock (its path was all tombstones): nothing to give back early.
            lock.released_early.add(swa.name)  # type: ignore[union-attr]
            return LockResult(0, None, {"swa_delta": 0})
        # Without a lock on node itself, the walk up would give back window locks other requests hold.
        # (A lock record from elsewhere, without swa_tokens, may have taken none: it is not refused.)
        gone = not swa.window_locked(node, lock) and (lock is None or took is not None)
        if node.lock_ref <= 0 or gone:
            raise ValueError(
                f"dec_swa_lock_only: {node!r} holds no window lock to give back; pass the node and the lock "
                "that inc_lock_ref returned, once (nothing was changed)"
            )
        before = swa.protected_size()
        swa.release_window(node, lock)
        for c in self.aux:
            if c.internal_priority < swa.internal_priority:
                c.unlock(node, lock)
                if lock is not None:
                    lock.released_early.add(c.name)
        if lock is not None:
            lock.released_early.add(swa.name)
        return LockResult(0, None, {"swa_delta": swa.protected_size() - before})

    # ------------------------------------------------------------------ evict

    def evict(self, num_tokens: int, swa_num_tokens: int = 0, mamba_num: int = 0, **targets: int) -> EvictResult:
        """Free at least ``num_tokens`` full slots (and the other components' targets), if it can.

        Components run in order, full first, on one tracker: one that earlier cascades
        already satisfied does not run.  Returns what each pool gained.
        """
        num_tokens = check_evict_count(num_tokens)
        want = {"full": num_tokens, "swa": check_evict_count(swa_num_tokens, "swa_num_tokens"),
                "mamba": check_evict_count(mamba_num, "mamba_num")}
        for k, v in targets.items():
            want[k] = check_evict_count(v, k)
        tracker = {c.name: 0 for c in self.components}
        if not self.disable:
            self.free_batch = []
            try:
                for c in self.components:
                    target = want.get(c.name, 0)
                    if tracker[c.name] >= target:
                        continue
                    c.evict(target, tracker)
            finally:
                batch, self.free_batch = self.free_batch, None
                if batch and self.tree_only:
                    pass  # the values are the caller's
                elif batch:
                    self.evicting(batch)
                    alloc = self.token_to_kv_pool_allocator
                    if self.page_size == 1:
                        # A free at page 1 appends its slots to the free list: one free of the
                        # concatenation leaves the order node-by-node frees do.
                        alloc.free(batch[0] if len(batch) == 1 else torch.cat(batch))
                    elif self.radix:
                        # SGLang's RadixCache frees each leaf with free_segment as it goes, paged in front
                        # in row order: the last leaf evicted ends up first.  One call does the same.
                        alloc.free_row_segments([(batch[0] if len(batch) == 1 else torch.cat(batch[::-1]), 0)])
                    else:
                        # With pages a free sorts the pages it is given: SGLang frees each evicted
                        # node on its own, so the free-list order is node by node here too.
                        for value in batch:
                            alloc.free(value)
        return EvictResult(tracker["full"], tracker.get("swa", 0), tracker.get("mamba", 0), tracker)

    def make_room(self, num_tokens: int) -> EvictResult:
        """Evict each token pool's shortfall for ``num_tokens`` new tokens."""
        alloc = self.token_to_kv_pool_allocator
        if "swa" in self.by_name:
            short = num_tokens - alloc.full_available_size()
            short_swa = num_tokens - alloc.swa_available_size()
            if short > 0 or short_swa > 0:
                return self.evict(max(short, 0), swa_num_tokens=max(short_swa, 0))
            return EvictResult()
        short = num_tokens - alloc.available_size()
        return self.evict(short) if short > 0 else EvictResult()

    def delete_leaf(self, x: UnifiedNode, tracker: dict[str, int]) -> None:
        """Remove unlocked leaf ``x`` with every component it holds (SGLang's leaf deletion)."""
        for c in self.components:
            if c.has_value(x):
                tracker[c.name] += c.free_value(x)
        self._last_walk = None
        self.leaves.discard(x)
        parent = x.parent
        del parent.children[x.ck]
        if self.enable_kv_events:
            record_removed(self._events, x)
        x.value = None
        # Detached: a lock or a resumed insert on it fails in path_to_root instead of pinning freed slots.
        x.parent = None
        self.update_leaf(parent)

    def drop_value(self, x: UnifiedNode, trigger: TreeComponent, tracker: dict[str, int]) -> None:
        """``trigger`` drops its value from ``x``; the lower-priority components there go too."""
        tracker[trigger.name] += trigger.free_value(x)
        is_leaf = x in self.leaves
        tp = 0 if is_leaf else trigger.internal_priority
        for c in self.aux:
            if c is trigger or not c.has_value(x):
                continue
            if (0 if is_leaf else c.internal_priority) > tp:
                continue
            if c.internal_priority >= trigger.internal_priority and c.lock_ref(x) != 0:
                continue
            tracker[c.name] += c.free_value(x)
        self.update_leaf(x)

    # ------------------------------------------------------------------ window frees

    def free_window_slots(self, reqs: Sequence[Req], pre_lens: Sequence[int] | None = None) -> int:
        swa = self._window
        if swa is None:
            return 0
        if pre_lens is None:
            pre_lens = [req.kv.kv_allocated_len for req in reqs]
        return free_swa_out_of_window_slots_batch(
            reqs, pre_lens, sliding_window_size=swa.window,
            page_size=self.page_size, req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool_allocator=self.token_to_kv_pool_allocator, is_chunk_cache=False)

    # ------------------------------------------------------------------ requests

    def row(self, kv: ReqKvInfo) -> torch.Tensor:
        """The req_to_token row ``kv`` registers (a view: components free and read slots through it)."""
        return self.req_to_token_pool.req_to_token[kv.req_pool_idx]

    def _check_row_claim(self, req: Req, committed: int) -> bool:
        """With ``strict``: refuse, before any component frees a slot, a row whose new whole pages the tree
        could not own (free, padding, another owner's); True when checked (the insert then claims unchecked)."""
        kv = req.kv
        protected = kv.cache_protected_len
        aligned = floor_align(committed, self.page_size)
        if not self.strict or aligned <= protected:
            return False
        slots = self.row(kv)[protected:aligned].to(torch.int64)
        self.token_to_kv_pool_allocator.check_claimable(slots, what=f"request {req.rid!r}")
        return True

    def check_node_locked(self, node: UnifiedNode, what: str) -> None:
        if node is not self.root_node:
            check_locked(self._path(node, what), node, what)

    def _prepare(self, req: Req, finished: bool, chunked: bool = False) -> tuple[InsertArgs, int]:
        """The row's claim (strict: refused before any component frees a slot), then each component's part
        of a request's insert; returns the insert's arguments and the length the components cut it to."""
        committed = req.kv.kv_committed_len
        row_checked = self._check_row_claim(req, committed)
        ins = InsertArgs(req.kv.cache_protected_len, 0, None, chunked, int(req.priority), row_checked=row_checked)
        eff = committed
        for c in self.aux:
            cut = c.prepare_insert(req, ins, finished)
            if cut is not None and cut < eff:
                eff = cut
        return ins, eff

    def cache_finished_req(self, req: Req, is_insert: bool = True) -> None:
        """Insert what ``req`` committed and drop its lock (SGLang's ``cache_finished_req``)."""
        if self.radix:
            self._radix_cache_finished_req(req, is_insert)
            return
        kv = req.kv
        committed = kv.kv_committed_len
        protected = kv.cache_protected_len
        if self.disable:
            self.free_kv_row(kv, [(protected, committed)])
            self.release_req_lock(req)
            for c in self.aux:
                c.after_cache_req(req, True, None, None)
            return
        self.check_req(req, "cache_finished_req")
        if is_insert and not self.aux and self.resume_finished(req):
            return  # inserted from the request's locked node (kvcore.tree.resume), the lock given back
        ins = None
        result = None
        if is_insert:
            check_request_ids(req, committed)  # before any component acts
            upper = self.resume_path(req) if self.aux else None
            ins, eff = self._prepare(req, True)
            aligned = floor_align(min(eff, committed), self.page_size)
            row = self.row(kv)
            if upper is not None and aligned >= protected:
                # From the request's locked node, as cache_unfinished_req resumes (the same hook calls).
                values = row[protected:aligned].to(torch.int64, copy=True)
                prefix_len, last = self._insert(req.fill_slice(protected, aligned), req.extra_key,
                                                aligned - protected, values, ins, resumed=(upper, row))
                result = InsertResult(prefix_len, last, duplicates_freed=True)
            elif aligned > 0:
                values = row[:aligned].to(torch.int64, copy=True)
                prefix_len, last = self._insert(req.fill_slice(0, aligned), req.extra_key, aligned, values, ins)
                result = InsertResult(prefix_len, last, duplicates_freed=True)
            # The unaligned tail, and what a component cut off the insert (SGLang frees both).
            start = max(aligned, protected)
            if committed > start:
                self.free_kv_row(kv, [(start, committed)])
        else:
            self.free_kv_row(kv, [(protected, committed)])
        self.release_req_lock(req)
        for c in self.aux:
            c.after_cache_req(req, True, ins, result)

    def cache_unfinished_req(self, req: Req, chunked: bool = False) -> None:
        """Insert ``fill_ids[:kv_committed_len]`` of a running request, re-match it and move its lock."""
        if self.radix:
            self._radix_cache_unfinished_req(req, chunked)
            return
        kv = req.kv
        committed = kv.kv_committed_len
        row = self.row(kv)
        if self.disable:
            req.prefix_indices = row[:committed].to(torch.int64, copy=True)
            return
        self.check_req(req, "cache_unfinished_req")
        if not self.aux:
            if not self.resume_unfinished(req, chunked):
                self._unfinished_from_root(req, chunked, row)
            return
        check_request_ids(req, committed)  # before any component acts
        upper = self.resume_path(req)
        ins, eff = self._prepare(req, False, chunked)
        if eff <= 0:
            self._left_uncached(req, ins, row)
        elif upper is not None and floor_align(eff, self.page_size) >= kv.cache_protected_len:
            self._unfinished_resumed(req, upper, ins, eff, row)
        else:
            self._unfinished_from_root(req, chunked, row, ins, eff)

    def _left_uncached(self, req: Req, ins: InsertArgs, row: torch.Tensor) -> None:
        """A component cut the whole insert (Mamba: no state to cache): the request keeps its row as it is."""
        req.prefix_indices = row[: req.kv.kv_committed_len].to(torch.int64, copy=True)
        for c in self.aux:
            c.after_cache_req(req, False, ins, None)

    def _unfinished_from_root(self, req: Req, chunked: bool, row: torch.Tensor, ins: InsertArgs | None = None,
                              eff: int = 0) -> None:
        """SGLang's ``cache_unfinished_req``: the whole prefix inserted from the root and matched again
        (``ins``, ``eff``: the components' preparation, done already, after the ids were checked)."""
        if ins is None:
            check_request_ids(req, req.kv.kv_committed_len)  # before any component acts
            ins, eff = self._prepare(req, False, chunked)
            if eff <= 0:
                self._left_uncached(req, ins, row)
                return
        aligned = floor_align(eff, self.page_size)
        values = row[:aligned].to(torch.int64, copy=True)
        ids = req.fill_slice(0, aligned)
        key = RadixKey(ids, req.extra_key)
        prefix_len, last = self._insert(ids, req.extra_key, aligned, values, ins) if aligned else (0, None)
        m = self.match_prefix(key, cow_mamba=False, req=req)
        new = m.device_indices
        new_len = int(new.numel())
        new_node = m.last_device_node
        if last is not None and new_len < aligned:
            # A window-limited re-match (too few live window tokens after a tombstone): SGLang takes
            # the shorter match, leaving [new_len, aligned) owned by the tree *and* the request, whose
            # next insert would then free the tree's slots as its duplicates.  As the swa backend
            # does, the prefix and the lock come from the inserted path instead.
            new = path_values(last, self.root_node, self._empty)
            new_len = aligned
            new_node = last
        self._move_request(req, new, new_len, new_node, row)
        for c in self.aux:
            c.after_cache_req(req, False, ins, InsertResult(prefix_len, last))

    def _move_request(self, req: Req, new: torch.Tensor, new_len: int, new_node: UnifiedNode,
                      row: torch.Tensor, resumed: bool = False) -> None:
        """After a running request's insert: its row takes the tree's slots, its lock moves to ``new_node``
        (``new``: the tree's slots of ``[0, new_len)``), and the next chunk may resume from there
        (``resumed``: ``new`` is the resume point's own buffer, kept as it is)."""
        kv = req.kv
        protected = kv.cache_protected_len
        committed = kv.kv_committed_len
        if new_len < protected:
            raise AssertionError(f"request {req.rid!r}: re-match found {new_len} < protected {protected}")
        if new_len > protected:
            row[protected:new_len] = new[protected:new_len].to(row.dtype)
        self.release_req_lock(req)
        lock = self.inc_lock_ref(new_node)
        if new_len < committed:
            req.prefix_indices = torch.cat([new[:new_len], row[new_len:committed].to(torch.int64)])
        else:
            req.prefix_indices = new[:new_len]
        kv.cache_protected_len = new_len
        req.last_node = new_node
        req.lock = lock
        if resumed:
            self.keep_resume_point(req, new)
        else:
            self.note_resume_point(req, new[:new_len])

    def _unfinished_resumed(self, req: Req, upper: list[UnifiedNode], ins: InsertArgs, eff: int,
                            row: torch.Tensor) -> None:
        """``cache_unfinished_req`` of a component set from the request's locked node (``upper``: its path).

        The same calls, in the same order, with the same arguments as :meth:`_unfinished_from_root`
        (every component's part included), less what only repeats the prefix: the insert passes
        the locked path's nodes without comparing their tokens (:meth:`_pass_locked`), and the
        re-match of the inserted key, which ends on the inserted node, runs the components'
        validators over the path's nodes instead of walking its tokens again; its slots come from
        the resume point's buffer.  A chunk costs its own length plus the path's depth.
        """
        kv = req.kv
        rp = self.resume_point(kv)
        assert rp is not None
        base = kv.cache_protected_len
        aligned = floor_align(eff, self.page_size)
        ids = req.fill_slice(base, aligned)
        values = row[base:aligned].to(torch.int64, copy=True)
        prefix_len, last = self._insert(ids, req.extra_key, aligned - base, values, ins, resumed=(upper, row))
        # The path from the root to the inserted node: the locked path, then what the insert hung below it.
        below, slots = path_below(rp, upper[-1], last, aligned)
        # The re-match (match_prefix of the inserted key): the deepest node every component accepts.
        validators = [c.validator() for c in self.aux]
        best, best_len, pos = self.root_node, 0, 0
        for x in itertools.chain(upper, below):
            pos += len(x.key)
            if all([v(x) for v in validators]):
                best, best_len = x, pos
        for c in self.aux:
            c.after_match(best)
        self._stamp_path(best)
        self._finish_match(MatchResult(slots[:best_len], best, best, best_len, {"matched_len": aligned}),
                           False, req)
        # A window-limited re-match takes the inserted path, as _unfinished_from_root does.
        self._move_request(req, slots, aligned, last, row, resumed=True)
        for c in self.aux:
            c.after_cache_req(req, False, ins, InsertResult(prefix_len, last))

    # -- the requests under RadixCache semantics (the insert leaves the duplicates to the cache's frees) --

    def _radix_cache_finished_req(self, req: Req, is_insert: bool) -> None:
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
            result = self._radix_insert_row(req, RadixKey(req.fill_ids[:aligned], req.extra_key), aligned, False)
            # Duplicates of what the tree already held, then the unaligned tail.
            self.free_kv_row(kv, [(protected, result.prefix_len), (aligned, committed)])
        self.release_req_lock(req)

    def _radix_cache_unfinished_req(self, req: Req, chunked: bool) -> None:
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
        result = self._radix_insert_row(req, key, aligned, chunked)
        self.free_kv_row(kv, [(protected, result.prefix_len)])
        match = self.match_prefix(key)
        if match.prefix_len != aligned:
            raise AssertionError(f"request {req.rid!r}: re-match found {match.prefix_len} of {aligned} inserted tokens")
        self.rebase_on_match(req, match, committed)
        self.note_resume_point(req, match.device_indices)

    def _radix_insert_row(self, req: Req, key: RadixKey, aligned: int, chunked: bool) -> InsertResult:
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
            self.token_to_kv_pool_allocator.check_claimable(values[protected:], what=f"request {req.rid!r}")
        return self._radix_insert(key, aligned, values, req.priority, chunked, self.strict)

    def _radix_reset(self) -> None:
        """RadixCache's reset: refused while a node is locked; every node's slots freed in one call."""
        protected = self.full.protected_size()
        if protected:
            raise RuntimeError(
                f"reset() while {protected} cached tokens are locked by running requests; "
                "finish them (or release their locks) first"
            )
        nodes = list(iter_subtree(self.root_node))
        if nodes and not self.tree_only:
            slots = torch.cat([x.value for x in nodes])
            if self.strict:
                self.token_to_kv_pool_allocator.disown(slots)
            self.token_to_kv_pool_allocator.free(slots)
        for node in nodes:
            node.parent = None
        self._build_empty()
        self.record_cleared()

    # -- the resumed insert's parts (kvcore.tree.resume; a full-only tree) -----

    def resume_insert(self, upper: list, ids: list[int], values: torch.Tensor, base: int, priority: int,
                      chunked: bool) -> tuple[int, Any, bool]:
        if self.radix:
            node = upper[-1]
            n = len(ids)
            path, pos, split_child, m = descend(node, ids, n, self.page_size)
            check_token_ids(ids, pos + m, refuse_bools=self.strict)
            self._last_walk = None
            v = self._radix_leaf_value(ids, values, pos + m, n, self.strict)  # the row was checked
            result = self._radix_commit(upper + path, split_child, m, ids, pos, n, v, priority, chunked,
                                        node.extra_key, base)
            return result.prefix_len, result.last_device_node, False
        ins = InsertArgs(0, 0, None, chunked, int(priority), row_checked=self.strict)
        pos, last = self._insert_full(ids, upper[-1].extra_key, len(ids), values, ins, None, upper)
        return base + pos, last, True

    def resume_stamp(self, node: Any) -> None:
        if not self.radix:
            self._stamp_path(node)
            return
        now = self.clock()
        root = self.root_node
        while node is not root:
            node.last_access_time = now
            node = node.parent
        root.last_access_time = now

    def resume_lock(self, nodes: list) -> int:
        return int(self.full.lock_path(nodes, []))

    # ------------------------------------------------------------------ introspection

    def _nodes(self) -> Iterator[UnifiedNode]:
        return iter_subtree(self.root_node)

    def iter_owned_slots(self) -> Iterator[SlotOwner]:
        for node in self._nodes():
            for c in self.components:
                if c.has_value(node):
                    yield from c.owned_slots(node)

    def sanity_check(self) -> None:
        """Recount every component's sizes and check the tree's structure (debug/tests)."""
        root = self.root_node
        for x in self._nodes():
            n = len(x.key)
            assert n > 0 and n % self.page_size == 0 and x.value is not None and x.value.numel() == n, x
            assert x.parent is not None and x.parent.children.get(x.ck) is x, x
            assert (x in self.leaves) == self.is_leaf(x), (x, x in self.leaves)
            for c in self.components:
                c.check(x)
        for c in self.components:
            c.check_totals(root)

    def format_tree(self) -> str:
        if self.radix:
            # RadixCache's pretty_print: one line per node, then the token count.
            lines = []
            stack = [(self.root_node, 0)]
            while stack:
                node, indent = stack.pop()
                lines.append(" " * indent + f" [{node.id}] {len(node.key)} {node.key[:10]} r={node.lock_ref}")
                for child in node.children.values():
                    stack.append((child, indent + 2))
            lines.append(f"#tokens: {self.total_size()}")
            return "\n".join(lines)

        def describe(x: UnifiedNode) -> str:
            flags = " ".join(f"{c.name}={'T' if not c.has_value(x) else c.lock_ref(x)}" for c in self.aux)
            return f"{x!r} {flags}"

        return "\n".join(tree_lines(self.root_node, describe))


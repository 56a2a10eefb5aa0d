"""A radix tree over full-attention KV and Mamba states (SGLang 0.5.19 ``MambaRadixCache`` semantics).

A hybrid model's full-attention layers keep KV per token (the ``full`` pool, as in
any radix cache); its Mamba layers keep one fixed-size state per sequence (the
``mamba`` pool, :class:`kvcore.pools.mamba_pool.MambaPool`).  A prefix is reusable only
up to a node that kept a state snapshot, so every node carries ``value`` (its
full-pool slots) and ``mamba_value`` (a one-slot tensor, or None: a *mamba
tombstone*).  What follows SGLang exactly, because the differential test checks it:

* ``match_prefix`` walks the key (splitting a partly matched edge), and answers with
  the deepest node on the path that has a state (``last_device_node``) and the slots
  up to it; ``mamba_branching_seqlen`` is the matched length floored to
  ``mamba_cache_chunk_size`` when the walk went past that node.  The whole path to it
  is refreshed in the full LRU order, only that node in the mamba order.  With
  ``cow_mamba=True`` a request without a state slot gets one (evicting the least
  recently used unlocked state if none is free, never the matched one) and
  ``mamba_cow_src_index`` names the node's slot to copy from.
* ``insert(key, value, mamba_value=, prev_prefix_len=)`` frees the caller's slots of the
  part already cached beyond ``prev_prefix_len`` (``duplicates_freed``), adds a leaf
  with the state or heals a tombstone at the end of the key; ``mamba_exist`` says the
  tree already had a state there (the caller frees its slot).
* Two LRU orders: full eviction frees unlocked leaves (state included) and the
  tombstone leaves that uncovers; mamba eviction takes the least recently used
  unlocked state anywhere: an internal node becomes a tombstone, a leaf is deleted.
  ``evict`` reports each walk's own count, as SGLang does.
* A lock holds the full path to the root and the state of its node only.
* ``page_size > 1`` is SGLang's extra-buffer mode: the tree works in pages, every request also
  holds two ping-pong tracking slots, and only tracked snapshots (``track_mamba_state``) go
  into the tree, from ``cache_unfinished_req`` / ``cache_finished_req``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, cast

import torch

from kvcore.cache import BasePrefixCache, EvictResult, InsertResult, LockResult, MatchResult, SlotOwner
from kvcore.config import CacheInitParams
from kvcore.keys import KeyLike, RadixKey
from kvcore.pools.mamba_pool import MambaReqState, MambaRequestStates, MambaRequestTable, mamba_state_of
from kvcore.pools.views import PoolView
from kvcore.tree import (
    AllPagesCleared,
    LRUList,
    Node,
    check_evict_count,
    check_locked,
    checked_key,
    child_key,
    lock_path,
    path_to_root,
    prefix_match_len,
    proven_prefix_len,
    record_removed,
    record_stored,
    split_node,
    unlock_path,
)
from kvcore_mamba.config import MambaConfig

if TYPE_CHECKING:
    from kvcore.record import Req, ReqKvInfo

__all__ = ["MambaRadixCache", "MambaTreeNode"]

_INT_DTYPES = frozenset({torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8})
_EMPTY = torch.empty((0,), dtype=torch.int64)


class MambaTreeNode(Node):
    """A radix edge with full-pool slots (``value``) and, unless it is a tombstone, a state (``mamba_value``).

    ``lock_ref`` is the full lock (the path to the root); ``mamba_lock_ref`` protects only
    this node's state.  ``prev``/``next`` link the full LRU order, ``mamba_prev``/``mamba_next``
    the mamba order (only nodes with a state are in it).
    """

    __slots__ = ("mamba_value", "mamba_lock_ref", "prev", "next", "mamba_prev", "mamba_next")

    # A split's upper half copies the full lock; it starts as a tombstone (a state cannot be split).
    split_copy = ("lock_ref", "last_access_time", "hit_count")

    def __init__(self, key: list[int] | None = None, value: Any = None, parent: Any = None, ck: Any = None,
                 extra_key: Any = None) -> None:
        super().__init__(key, value, parent, ck, extra_key)
        self.mamba_value: torch.Tensor | None = None
        self.mamba_lock_ref = 0
        self.prev: Any = None
        self.next: Any = None
        self.mamba_prev: Any = None
        self.mamba_next: Any = None

    @property
    def mamba_evicted(self) -> bool:
        return self.mamba_value is None

    def __repr__(self) -> str:
        ids = self.key if len(self.key) <= 6 else f"{self.key[:6]}...+{len(self.key) - 6}"
        state = "tombstone" if self.mamba_value is None else f"state={int(self.mamba_value[0])}"
        return (f"<mamba node {self.id} len={len(self.key)} lock_ref={self.lock_ref} "
                f"mamba_lock_ref={self.mamba_lock_ref} {state} key={ids}>")


def _sentinel() -> MambaTreeNode:
    return MambaTreeNode()


class MambaRadixCache(BasePrefixCache):
    """SGLang's ``MambaRadixCache`` on kvcore's pools; the class is its own ``create_cache`` factory.

    Extra attributes: ``mamba_pool`` (the states), ``mamba_allocator`` (its slot allocator),
    ``mamba_cache_chunk_size``.  Counters (``stats()``): ``cow_copies`` (states copied from a
    node for an admitted request), ``state_clears`` (fresh states zeroed), ``state_snapshots``
    (states copied into the tree by ``cache_unfinished_req``), ``snapshot_skips`` (prefill
    chunks left uncached because no state slot could be had).
    """

    def __init__(self, params: CacheInitParams):
        config = cast(MambaConfig, params.config)
        r2t = params.req_to_token_pool
        if not isinstance(r2t, MambaRequestTable):
            raise TypeError(f"the mamba backend needs a request table with state slots (a HybridReqToTokenPool), "
                            f"got {type(r2t).__name__}")
        super().__init__(params)
        self.config = config
        self.req_to_token_pool = r2t
        self._r2t = r2t
        # The full pool's claim/disown (strict mode) are TokenToKVPoolAllocator's, beyond the TokenAllocator protocol.
        self._full: Any = params.token_to_kv_pool_allocator
        if self.page_size > 1 and not r2t.extra_buffer:
            raise ValueError(f"page_size={self.page_size}: the mamba backend needs the extra-buffer request table "
                             "(HybridReqToTokenPool(extra_buffer=True)) for pages larger than one token")
        # SGLang's enable_mamba_extra_buffer: ping-pong tracking slots per request (page_size > 1).
        self.extra_buffer = bool(r2t.extra_buffer)
        self.mamba_pool = r2t.mamba_pool
        self.mamba_allocator = r2t.mamba_allocator
        self.mamba_cache_chunk_size = int(config.mamba_cache_chunk_size)
        if self.page_size > 1 and self.mamba_cache_chunk_size % self.page_size:
            raise ValueError(f"mamba_cache_chunk_size={self.mamba_cache_chunk_size} is not a multiple of "
                             f"page_size={self.page_size}")
        self.disable = bool(config.disable)
        self.enable_kv_events = bool(config.enable_kv_events)
        self.device = torch.device(self.token_to_kv_pool_allocator.device)
        self._events: list = []
        # Admission copies, extra-buffer tracking, donations and backups (shared with unified's mamba component).
        self.states = MambaRequestStates(
            r2t, page_size=self.page_size, chunk_size=self.mamba_cache_chunk_size,
            track_interval=int(config.mamba_track_interval), evict_states=self._evict_states)
        self._init_tree()

    # ------------------------------------------------------------------ state

    def _init_tree(self) -> None:
        root = MambaTreeNode([], torch.empty((0,), dtype=torch.int64, device=self.device))
        root.lock_ref = 1
        root.mamba_lock_ref = 1
        self.root_node = root
        self.full_lru_list = LRUList(_sentinel, "prev", "next", "lock_ref", "full LRU")
        self.mamba_lru_list = LRUList(_sentinel, "mamba_prev", "mamba_next", "mamba_lock_ref", "mamba LRU")
        self.full_evictable_size_ = 0
        self.full_protected_size_ = 0
        self.mamba_evictable_size_ = 0
        self.mamba_protected_size_ = 0
        self._empty_match = MatchResult(
            torch.empty((0,), dtype=torch.int64, device=self.device), root, root, None,
            {"mamba_branching_seqlen": None},
        )

    def _all_nodes(self) -> Iterator[MambaTreeNode]:
        stack = list(self.root_node.children.values())
        while stack:
            x = stack.pop()
            yield x
            stack.extend(x.children.values())

    def reset(self) -> None:
        """Drop the whole tree and give every slot it held (full and state) back."""
        full: list[torch.Tensor] = []
        states: list[torch.Tensor] = []
        for x in self._all_nodes():
            full.append(x.value)
            if x.mamba_value is not None:
                states.append(x.mamba_value)
            x.parent = None
        self._release(full, states)
        if self.enable_kv_events:
            self._events.append(AllPagesCleared())
        self._init_tree()

    def _release(self, full: list[torch.Tensor], states: list[torch.Tensor]) -> None:
        """Give the tree's slots back, in the order SGLang frees them (page size 1: appended in order)."""
        if full:
            slots = full[0] if len(full) == 1 else torch.cat(full)
            if self.strict:
                self._full.disown(slots)
            if self.page_size == 1:
                self.token_to_kv_pool_allocator.free(slots)
            else:
                # SGLang frees node by node, each in row order (free_segment), not sorted.
                for v in full:
                    self._full.free_segment(v, start_pos=0)
        if states:
            idx = states[0] if len(states) == 1 else torch.cat(states)
            if self.strict:
                self.mamba_allocator.disown(idx)
            self.mamba_pool.free(idx)

    def take_events(self) -> list:
        events, self._events = self._events, []
        return events

    def stats(self) -> dict[str, int]:
        return self.states.stats()

    # ------------------------------------------------------------------ sizes and pools

    def full_evictable_size(self) -> int:
        return self.full_evictable_size_

    def full_protected_size(self) -> int:
        return self.full_protected_size_

    def mamba_evictable_size(self) -> int:
        return self.mamba_evictable_size_

    def mamba_protected_size(self) -> int:
        return self.mamba_protected_size_

    def evictable_size(self) -> int:
        """The full side (SGLang raises here; kvcore's interface answers with the full pool)."""
        return self.full_evictable_size_

    def protected_size(self) -> int:
        return self.full_protected_size_

    def cached_sizes(self) -> dict[str, tuple[int, int]]:
        return {
            "full": (self.full_evictable_size_, self.full_protected_size_),
            "mamba": (self.mamba_evictable_size_, self.mamba_protected_size_),
        }

    def pools(self) -> list[PoolView]:
        return [*self.token_to_kv_pool_allocator.pool_views(),
                PoolView("mamba", self.mamba_allocator, record_slots=self._record_states)]

    @staticmethod
    def _record_states(kv: ReqKvInfo) -> tuple[torch.Tensor, int]:
        comp = mamba_state_of(kv)
        if comp is None:
            return _EMPTY, 0
        slots = comp.slots()
        return slots, int(slots.numel())

    def iter_owned_slots(self) -> Iterator[SlotOwner]:
        for x in self._all_nodes():
            yield SlotOwner("full", f"node {x.id}", x.value)
            if x.mamba_value is not None:
                yield SlotOwner("mamba", f"node {x.id}", x.mamba_value)

    def sanity_check(self) -> None:
        """Recount sizes and LRU lists from the tree (SGLang's sanity check, plus the tombstone-leaf rule)."""
        fe = fp = me = mp = nodes = states = 0
        for x in self._all_nodes():
            nodes += 1
            assert x in self.full_lru_list, f"{x!r} is not in the full LRU list"
            if x.lock_ref:
                fp += len(x.key)
            else:
                fe += len(x.key)
            if x.mamba_value is None:
                assert x not in self.mamba_lru_list, f"tombstone {x!r} is in the mamba LRU list"
                assert x.mamba_lock_ref == 0, f"tombstone {x!r} holds a mamba lock"
                assert x.children or x.lock_ref, f"unlocked tombstone leaf {x!r}"
            else:
                states += 1
                assert x in self.mamba_lru_list, f"{x!r} has a state but is not in the mamba LRU list"
                assert x.lock_ref >= x.mamba_lock_ref, f"{x!r}: mamba lock without the full lock"
                if x.mamba_lock_ref:
                    mp += 1
                else:
                    me += 1
        assert len(self.full_lru_list) == nodes, f"full LRU holds {len(self.full_lru_list)} of {nodes} nodes"
        assert len(self.mamba_lru_list) == states, f"mamba LRU holds {len(self.mamba_lru_list)} of {states} states"
        got = (self.full_evictable_size_, self.full_protected_size_, self.mamba_evictable_size_,
               self.mamba_protected_size_)
        assert got == (fe, fp, me, mp), f"sizes (full e/p, mamba e/p) {got} != recount {(fe, fp, me, mp)}"

    # ------------------------------------------------------------------ match

    def _split(self, child: MambaTreeNode, k: int) -> MambaTreeNode:
        """SGLang's ``_split_node``: the upper half is a new tombstone node; the full LRU puts the
        lower half first, then the upper half, at the front; the mamba order is unchanged."""
        upper = split_node(child, k, MambaTreeNode(), self.page_size)
        lru = self.full_lru_list
        lru.remove(child)
        lru.add_mru(upper)
        lru.add_mru(child)
        return upper

    def _walk(self, rk: RadixKey) -> tuple[list[MambaTreeNode], MambaTreeNode, int]:
        """SGLang's ``_match_prefix_helper``: (matched nodes, the deepest with a state, how many nodes up to it)."""
        ids = rk.token_ids
        n = len(ids)
        node = self.root_node
        nodes: list[MambaTreeNode] = []
        best, best_count = node, 0
        pos = 0
        page = self.page_size
        ck: Any = child_key(ids, 0, page, rk.extra_key)
        while pos < n:
            child = node.children.get(ck)
            if child is None:
                break
            if node.mamba_value is not None:
                best, best_count = node, len(nodes)
            ckey = child.key
            end = pos + len(ckey)
            if end <= n and ids[pos:end] == ckey:
                nodes.append(child)
                node = child
                pos = end
                if pos < n:
                    ck = ids[pos] if page == 1 else tuple(ids[pos : pos + page])
                continue
            m = prefix_match_len(ids, pos, ckey, min(len(ckey), n - pos), page)
            node = self._split(child, m)
            nodes.append(node)
            break
        if node.mamba_value is not None:
            best, best_count = node, len(nodes)
        return nodes, best, best_count

    def match_prefix(self, key: KeyLike, cow_mamba: bool = False, req: Req | None = None) -> MatchResult:
        """The cached prefix of ``key`` up to the deepest node with a state (see the module docstring).

        ``cow_mamba=True`` with ``req``: a request that holds no state slot gets one
        (``req.kv.components["mamba"].mamba_pool_idx``) and ``mamba_cow_src_index`` names the
        matched node's slot (the caller copies before the forward, as in SGLang); nothing
        matched, nothing taken.  ValueError, with nothing changed, for a request that already
        holds a slot.
        """
        rk = checked_key(key)
        comp: MambaReqState | None = None
        if cow_mamba:
            if req is None:
                raise ValueError("match_prefix(cow_mamba=True) needs the request (req=...)")
            comp = mamba_state_of(req.kv, create=True)
            if comp is not None and comp.holds_mamba:
                raise ValueError(
                    f"match_prefix(cow_mamba=True): request {getattr(req, 'rid', req)!r} already holds state slot "
                    f"{int(comp.mamba_pool_idx)}; free it first"  # type: ignore[arg-type]
                )
        if self.disable or len(rk) == 0:
            return self._empty_match
        nodes, best, best_count = self._walk(rk)
        root = self.root_node
        self.full_lru_list.touch_path(best, root)
        if best is not root and best.mamba_value is not None:
            self.mamba_lru_list.touch(best)
        branching = None
        if len(nodes) > best_count:
            chunk = self.mamba_cache_chunk_size
            aligned = sum(len(x.key) for x in nodes) // chunk * chunk
            branching = aligned if aligned > 0 else None
        if cow_mamba and best.mamba_value is not None:
            dst = self.mamba_pool.alloc(1)
            if dst is None:
                self.inc_lock_ref(best)
                self.evict(0, mamba_num=1)
                dst = self.mamba_pool.alloc(1)
                self.dec_lock_ref(best)
                if dst is None:
                    raise RuntimeError(
                        f"match_prefix(cow_mamba=True): no state slot free or evictable "
                        f"(mamba_size={self.mamba_pool.size}, all states locked)"
                    )
            assert req is not None  # refused above when cow_mamba
            comp = mamba_state_of(req.kv, create=True)
            assert comp is not None
            comp.mamba_pool_idx = dst[0]
            comp.mamba_cow_src_index = best.mamba_value
            comp.mamba_needs_clear = False
        if comp is not None:
            comp.mamba_branching_seqlen = branching
        kept = nodes[:best_count]
        if not kept:
            value = torch.empty((0,), dtype=torch.int64, device=self.device)
        elif len(kept) == 1:
            value = kept[0].value
        else:
            value = torch.cat([x.value for x in kept])
        return MatchResult(value, best, best, None, {"mamba_branching_seqlen": branching})

    def match_request(self, req: Req, key: KeyLike) -> MatchResult:
        """The engine's admission match: SGLang's ``cow_mamba`` match, with the slot taken with the row.

        ``kvcore.Engine`` locks the matched node and then takes the request's row with
        ``req_to_token_pool.alloc``; :class:`HybridReqToTokenPool` gives the state slot at
        that moment (evicting the least recently used unlocked state if none is free, as
        SGLang's match does) and this cache copies the node's state into it.  An admission
        that is cancelled between the two therefore holds no state slot.
        """
        comp = mamba_state_of(req.kv, create=True)
        assert comp is not None
        result = self.match_prefix(key)
        if not comp.holds_mamba:
            node = result.last_device_node
            comp.cow_node = node if node.mamba_value is not None else None
            comp.mamba_branching_seqlen = result.mamba_branching_seqlen
        return result

    def _evict_states(self, n: int) -> None:
        self.evict(0, mamba_num=n)

    # ------------------------------------------------------------------ insert

    def _descend(self, rk: RadixKey) -> tuple[MambaTreeNode, int, MambaTreeNode | None, int]:
        """Read-only walk: (last fully matched node, its depth, the child a match ends in or None, tokens in it)."""
        ids = rk.token_ids
        n = len(ids)
        node = self.root_node
        pos = 0
        page = self.page_size
        ck: Any = child_key(ids, 0, page, rk.extra_key)
        while pos < n:
            child = node.children.get(ck)
            if child is None:
                break
            ckey = child.key
            end = pos + len(ckey)
            if end <= n and ids[pos:end] == ckey:
                node, pos = child, end
                if pos < n:
                    ck = ids[pos] if page == 1 else tuple(ids[pos : pos + page])
                continue
            return node, pos, child, prefix_match_len(ids, pos, ckey, min(len(ckey), n - pos), page)
        return node, pos, None, 0

    def _needs_state(self, rk: RadixKey) -> tuple[bool, int]:
        """Whether inserting ``rk`` stores a new state, and the length already cached."""
        node, pos, inside, m = self._descend(rk)
        if pos + m < len(rk) or inside is not None:
            return True, pos + m
        return node.mamba_value is None, pos

    @staticmethod
    def _checked_slots(value: Any, n: int, what: str) -> torch.Tensor:
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{what} must be a 1-D integer tensor of slots, got {type(value).__name__}")
        if value.dtype not in _INT_DTYPES or value.dim() != 1:
            raise TypeError(f"{what} must be a 1-D integer tensor, got shape {tuple(value.shape)} dtype {value.dtype}")
        if value.shape[0] != n:
            raise ValueError(f"{what} has {value.shape[0]} slots for {n} tokens")
        return value.to(torch.int64)

    def insert(self, key: KeyLike, value: torch.Tensor | None = None, *, mamba_value: torch.Tensor | None = None,
               prev_prefix_len: int = 0, chunked: bool = False, priority: int = 0) -> InsertResult:
        """Insert ``key`` -> ``value`` (full slots) with the state ``mamba_value`` at its end.

        The caller's slots of the already-cached part beyond ``prev_prefix_len`` are freed here
        (``duplicates_freed``).  ``mamba_exist``: the tree already held a state at the end, so
        ``mamba_value`` stays the caller's.  ``mamba_value=None`` takes a fresh zeroed state slot
        (evicting a state if none is free) when one is needed; ``value=None`` takes fresh full
        slots.  Every bad input (ids, shapes, a free, padding, out-of-range or tree-owned slot)
        raises before anything changes.
        """
        rk = checked_key(key)
        n = len(rk)
        fresh = value is None
        if not fresh:
            value = self._checked_slots(value, n, "insert value")
        prev = check_evict_count(prev_prefix_len, "prev_prefix_len")
        if mamba_value is not None:
            mamba_value = self._checked_slots(mamba_value.reshape(-1) if isinstance(mamba_value, torch.Tensor)
                                              else mamba_value, 1, "mamba_value")
        if n % self.page_size:
            # The tree keeps whole pages; the partial last page stays the caller's.  A given state
            # belongs to the key's end, so it cannot be put at a shorter (page-aligned) length.
            if mamba_value is not None:
                raise ValueError(
                    f"insert: a key of {n} tokens is not a whole number of pages (page_size={self.page_size}) "
                    "and its mamba_value is the state at its end; insert a page-aligned key"
                )
            n -= n % self.page_size
            rk = rk[:n]
            if value is not None:
                value = value[:n]
        if self.disable or n == 0:
            return InsertResult(0, self.root_node, duplicates_freed=True, mamba_exist=True)
        if self.strict:
            # Refused (nothing changed, not even a state slot taken and given back) unless the new
            # slots may become the tree's and the duplicates it frees are the caller's.
            if value is not None:
                # prev_prefix_len never narrows the check: only the tree's own slots skip it.
                lo = proven_prefix_len(self.root_node, rk.token_ids, n, self.page_size, rk.extra_key, value, prev)
                self._full.check_claimable(value[lo:], what="insert")
            if mamba_value is not None:
                self.mamba_allocator.check_claimable(mamba_value, what="insert mamba_value")
        needs_state, cached = self._needs_state(rk)
        own_state = False
        if mamba_value is None and needs_state:
            mamba_value = self.mamba_pool.alloc(1)
            if mamba_value is None:
                self.evict(0, mamba_num=1)
                mamba_value = self.mamba_pool.alloc(1)
                if mamba_value is None:
                    raise ValueError("insert: mamba_value is missing and no state slot is free or evictable")
                needs_state, cached = self._needs_state(rk)  # the eviction may have changed the path
            self.mamba_pool.clear_slots(mamba_value)
            own_state = True
        if fresh:
            value = self.token_to_kv_pool_allocator.alloc(n)
            if value is None:
                if own_state:
                    self.mamba_pool.free(mamba_value)
                raise ValueError(f"insert: value is None and {n} free full slots are not available")
        assert value is not None and (mamba_value is not None or not needs_state)
        result = self._insert_helper(rk, value, mamba_value, prev)
        if result.mamba_exist and own_state:
            self.mamba_pool.free(mamba_value)
        return result

    def _insert_helper(self, rk: RadixKey, value: torch.Tensor, mamba_value: torch.Tensor | None,
                       prev: int) -> InsertResult:
        """SGLang's ``_insert_helper`` (LRU order included); inputs are already checked."""
        ids = rk.token_ids
        n = len(ids)
        lru = self.full_lru_list
        node = self.root_node
        pos = 0
        page = self.page_size
        dups: list[tuple[torch.Tensor, int]] = []
        ck: Any = child_key(ids, 0, page, rk.extra_key)
        while pos < n:
            child = node.children.get(ck)
            if child is None:
                break
            node = child
            lru.touch(node)
            ckey = node.key
            end = pos + len(ckey)
            m = len(ckey) if end <= n and ids[pos:end] == ckey else prefix_match_len(
                ids, pos, ckey, min(len(ckey), n - pos), page)
            if prev < pos + m:
                start = max(prev - pos, 0) + pos
                dups.append((value[start : pos + m], start))
            pos += m
            if m < len(ckey):
                node = self._split(node, m)
            if pos < n:
                ck = ids[pos] if page == 1 else tuple(ids[pos : pos + page])
        if dups:
            if page == 1:
                freed = dups[0][0] if len(dups) == 1 else torch.cat([d for d, _ in dups])
                if freed.numel():
                    self.token_to_kv_pool_allocator.free(freed)
            else:
                for d, start in dups:
                    self._full.free_segment(d, start_pos=start)
        mamba_exist = False
        if pos < n:
            assert mamba_value is not None
            v = value[pos:n].clone()
            leaf = MambaTreeNode(ids[pos:n], v, node, ck, rk.extra_key)
            leaf.mamba_value = mamba_value.clone()
            if self.strict:
                self._full.claim(v, checked=False)
                self.mamba_allocator.claim(leaf.mamba_value, checked=False)
            node.children[ck] = leaf
            lru.add_mru(leaf)
            self.mamba_lru_list.add_mru(leaf)
            self.full_evictable_size_ += n - pos
            self.mamba_evictable_size_ += 1
            if self.enable_kv_events:
                record_stored(self._events, leaf, self.page_size)
            node = leaf
        elif node.mamba_value is None:
            assert mamba_value is not None
            node.mamba_value = mamba_value.clone()
            if self.strict:
                self.mamba_allocator.claim(node.mamba_value, checked=False)
            lru.touch(node)
            self.mamba_lru_list.add_mru(node)
            self.mamba_evictable_size_ += 1
        else:
            mamba_exist = True
            lru.touch(node)
        return InsertResult(pos, node, duplicates_freed=True, mamba_exist=mamba_exist)

    # ------------------------------------------------------------------ locks

    def _path(self, node: Any, what: str) -> list[MambaTreeNode]:
        if not isinstance(node, MambaTreeNode):
            raise TypeError(f"{what}: expected a MambaTreeNode, got {type(node).__name__}")
        return path_to_root(node, self.root_node, what)

    def inc_lock_ref(self, node: MambaTreeNode) -> LockResult:
        """Lock the full path from ``node`` to the root and ``node``'s own state."""
        if self.disable:
            return LockResult(delta=0)
        path = self._path(node, "inc_lock_ref")
        if node.mamba_value is not None:
            if node.mamba_lock_ref == 0:
                self.mamba_evictable_size_ -= 1
                self.mamba_protected_size_ += 1
            node.mamba_lock_ref += 1
        delta = lock_path(path)
        self.full_evictable_size_ -= delta
        self.full_protected_size_ += delta
        return LockResult(delta=delta)

    def dec_lock_ref(self, node: MambaTreeNode, lock: LockResult | None = None) -> LockResult:
        if self.disable:
            return LockResult(delta=0)
        path = self._path(node, "dec_lock_ref")
        if lock is not None:
            lock.check_not_released("dec_lock_ref", node)
        check_locked(path, node, "dec_lock_ref")
        if node.mamba_value is not None and node is not self.root_node and node.mamba_lock_ref <= 0:
            raise ValueError(f"dec_lock_ref: the state of {node!r} is not locked; was this lock already released?")
        if node.mamba_value is not None:
            if node.mamba_lock_ref == 1:
                self.mamba_evictable_size_ += 1
                self.mamba_protected_size_ -= 1
            node.mamba_lock_ref -= 1
        delta = unlock_path(path)
        self.full_evictable_size_ += delta
        self.full_protected_size_ -= delta
        if lock is not None:
            lock.released = True
        return LockResult(delta=-delta)

    def check_node_locked(self, node: Any, what: str) -> None:
        check_locked(self._path(node, what), node, what)

    # ------------------------------------------------------------------ eviction

    def evict(self, num_tokens: int, mamba_num: int = 0) -> EvictResult:
        """Free at least ``num_tokens`` full slots (unlocked leaves) and ``mamba_num`` states (any unlocked node).

        Each count is what that walk freed, as in SGLang: full slots freed while evicting
        states (a deleted leaf) and states freed with full leaves are not counted.
        """
        num_tokens = check_evict_count(num_tokens)
        mamba_num = check_evict_count(mamba_num, "mamba_num")
        if self.disable:
            return EvictResult()
        full: list[torch.Tensor] = []
        states: list[torch.Tensor] = []
        full_n = self._evict_full(num_tokens, full, states) if num_tokens > 0 else 0
        mamba_n = self._evict_mamba(mamba_num, full, states) if mamba_num > 0 else 0
        self._release(full, states)
        return EvictResult(num_tokens_evicted=full_n, mamba_num_evicted=mamba_n)

    def _evict_leaf(self, x: MambaTreeNode, for_mamba: bool, full: list, states: list
                    ) -> tuple[int, MambaTreeNode, MambaTreeNode | None]:
        """Delete leaf ``x`` and the tombstone leaves above it: (full slots freed, surviving ancestor, next)."""
        assert x.lock_ref == 0 and x.mamba_lock_ref == 0 and x.mamba_value is not None, f"cannot evict {x!r}"
        events = self._events if self.enable_kv_events else None
        if events is not None:
            record_removed(events, x)
        full.append(x.value)
        states.append(x.mamba_value)
        freed = len(x.value)
        if for_mamba:
            x_next = self.mamba_lru_list.prev_unlocked(x)
        else:
            x_next = self.full_lru_list.prev_unlocked(x, leaf_only=True)
        self.full_lru_list.remove(x)
        self.mamba_lru_list.remove(x)
        parent = x.parent
        del parent.children[x.ck]
        self.full_evictable_size_ -= len(x.key)
        self.mamba_evictable_size_ -= 1
        x.parent = None
        root = self.root_node
        while parent is not root and parent.mamba_value is None and not parent.children and parent.lock_ref == 0:
            if events is not None:
                record_removed(events, parent)
            full.append(parent.value)
            freed += len(parent.value)
            self.full_lru_list.remove(parent)
            up = parent.parent
            del up.children[parent.ck]
            self.full_evictable_size_ -= len(parent.key)
            parent.parent = None
            parent = up
        return freed, parent, x_next

    def _evict_full(self, n: int, full: list, states: list) -> int:
        lru = self.full_lru_list
        x = lru.lru_unlocked(leaf_only=True)
        evicted = 0
        while evicted < n and x is not None:
            freed, survivor, x_next = self._evict_leaf(x, False, full, states)
            evicted += freed
            if not survivor.children:
                # The ancestor became a leaf: it may be the least recently used one now.
                x_next = lru.lru_unlocked(leaf_only=True)
            x = x_next
        return evicted

    def _evict_mamba(self, n: int, full: list, states: list) -> int:
        lru = self.mamba_lru_list
        x = lru.lru_unlocked()
        evicted = 0
        while evicted < n and x is not None:
            if x.children:
                states.append(x.mamba_value)
                evicted += 1
                x_next = lru.prev_unlocked(x)
                lru.remove(x)
                self.mamba_evictable_size_ -= 1
                x.mamba_value = None
            else:
                _, _, x_next = self._evict_leaf(x, True, full, states)
                evicted += 1
            x = x_next
        return evicted

    # ------------------------------------------------------------------ requests

    def _state(self, req: Req, what: str) -> MambaReqState:
        comp = mamba_state_of(req.kv)
        if comp is None or not comp.holds_mamba:
            raise ValueError(
                f"{what}: request {req.rid!r} holds no state slot (req.kv.components['mamba'].mamba_pool_idx); "
                "admit it through kvcore.Engine or a HybridReqToTokenPool first"
            )
        return comp

    # ------------------------------------------------------------------ extra-buffer mode (page_size > 1)

    def track_mamba_state(self, req: Req) -> int | None:
        """Replay SGLang's scheduler tracking over what ``req`` computed since the last call.

        See :meth:`kvcore.pools.mamba_pool.MambaRequestStates.track`; ``cache_unfinished_req`` /
        ``cache_finished_req`` call it first to catch up.  Returns the latest tracked length,
        or None.  No-op at page size 1.
        """
        return self.states.track(req)

    def _cache_finished_extra(self, req: Req, is_insert: bool) -> None:
        """SGLang's extra-buffer ``cache_finished_req``: cache at the last tracked length, donate that slot."""
        kv = req.kv
        comp = mamba_state_of(kv)
        if comp is None or (comp.mamba_pool_idx is None and comp.mamba_ping_pong_track_buffer is None):
            raise ValueError(
                f"cache_finished_req: request {req.rid!r} holds no state slot; admit it through kvcore.Engine or "
                "a HybridReqToTokenPool first"
            )
        committed = kv.kv_committed_len
        protected = kv.cache_protected_len
        r2t = self._r2t
        keep: int | None = None
        if self.disable or not is_insert or comp.mamba_ping_pong_track_buffer is None:
            self.free_kv_row(kv, [(protected, committed)])
        else:
            self.track_mamba_state(req)
            cache_len = comp.mamba_last_track_seqlen or 0
            if cache_len != committed:
                self.free_kv_row(kv, [(max(cache_len, protected), committed)])
            keep = comp.mamba_last_track_idx
            row = r2t.req_to_token[kv.req_pool_idx]
            values = row[:cache_len].to(torch.int64)
            mamba_value = self.states.tracked_slot(comp)
            result = self.insert(RadixKey(req.fill_ids[:cache_len], req.extra_key), values,
                                 mamba_value=mamba_value, prev_prefix_len=protected)
            if result.mamba_exist:
                keep = None
        r2t.free_mamba_cache(kv, keep=keep)
        self.release_req_lock(req)

    def _cache_unfinished_extra(self, req: Req, chunked: bool) -> None:
        """SGLang's extra-buffer ``cache_unfinished_req``: donate the tracked ping-pong slot to the tree."""
        kv = req.kv
        committed = kv.kv_committed_len
        row = self.req_to_token_pool.req_to_token[kv.req_pool_idx]
        comp = mamba_state_of(kv)
        if comp is None or comp.mamba_ping_pong_track_buffer is None:
            raise ValueError(
                f"cache_unfinished_req: request {req.rid!r} holds no ping-pong tracking slots; admit it through "
                "kvcore.Engine or a HybridReqToTokenPool first"
            )
        cache_len = self.track_mamba_state(req)
        if self.disable or cache_len is None:
            req.prefix_indices = row[:committed].to(torch.int64)
            return
        donated = self.states.donate_tracked(kv)
        if donated is None:
            # SGLang asserts here; kvcore leaves this snapshot uncached and carries on.
            req.prefix_indices = row[:committed].to(torch.int64)
            return
        protected = kv.cache_protected_len
        key = RadixKey(req.fill_ids[:cache_len], req.extra_key)
        result = self.insert(key, row[:cache_len].to(torch.int64), mamba_value=donated,
                             prev_prefix_len=protected, chunked=chunked)
        if result.mamba_exist:
            self.mamba_pool.free(donated)
        self.rebase_on_match(req, self.match_prefix(key), committed)
        comp.mamba_last_track_seqlen = None

    def cache_finished_req(self, req: Req, is_insert: bool = True) -> None:
        """Cache ``fill_ids[:kv_committed_len]`` with the request's state (donated to the tree unless it had one).

        Page size > 1 (extra-buffer mode): cache ``fill_ids[:mamba_last_track_seqlen]`` (nothing
        when no snapshot was tracked) with the tracked ping-pong slot, which the tree keeps unless
        it had a state there; the committed KV past that length is freed, and every other state
        slot of the request goes back.
        """
        self.check_req(req, "cache_finished_req")
        if self.extra_buffer:
            return self._cache_finished_extra(req, is_insert)
        kv = req.kv
        comp = mamba_state_of(kv)
        if is_insert and not self.disable:
            comp = self._state(req, "cache_finished_req")
        committed = kv.kv_committed_len
        protected = kv.cache_protected_len
        r2t = self._r2t
        mamba_exist = True
        if self.disable or not is_insert:
            self.free_kv_row(kv, [(protected, committed)])
        else:
            assert comp is not None and comp.mamba_pool_idx is not None
            row = r2t.req_to_token[kv.req_pool_idx]
            values = row[:committed].to(torch.int64)
            result = self.insert(RadixKey(req.fill_ids[:committed], req.extra_key), values,
                                 mamba_value=comp.mamba_pool_idx.reshape(1), prev_prefix_len=protected)
            mamba_exist = result.mamba_exist
        if comp is not None and comp.holds_mamba:
            if mamba_exist:
                r2t.free_mamba_cache(kv)
            else:
                # Donated: the tree owns the slot now.
                comp.mamba_pool_idx = None
                comp.mamba_cow_src_index = None
                comp.cow_node = None
        self.release_req_lock(req)

    def cache_unfinished_req(self, req: Req, chunked: bool = False) -> None:
        """Snapshot the request's state into the tree at ``kv_committed_len`` (SGLang copies it into a new slot).

        Page size > 1 (extra-buffer mode): the tree takes the tracked ping-pong slot at
        ``mamba_last_track_seqlen`` and the request gets a fresh slot in its place; nothing is
        cached when no snapshot was tracked since the last call.
        """
        self.check_req(req, "cache_unfinished_req")
        if self.extra_buffer:
            return self._cache_unfinished_extra(req, chunked)
        kv = req.kv
        committed = kv.kv_committed_len
        row = self.req_to_token_pool.req_to_token[kv.req_pool_idx]
        if self.disable:
            req.prefix_indices = row[:committed].to(torch.int64)
            return
        comp = self._state(req, "cache_unfinished_req")
        assert comp.mamba_pool_idx is not None
        protected = kv.cache_protected_len
        donated = self.states.alloc_slot()
        if donated is None:
            # SGLang asserts here; kvcore leaves this chunk uncached and carries on.
            self.states.snapshot_skips += 1
            req.prefix_indices = row[:committed].to(torch.int64)
            return
        self.mamba_pool.copy_from(comp.mamba_pool_idx.reshape(1), donated)
        self.states.state_snapshots += 1
        key = RadixKey(req.fill_ids[:committed], req.extra_key)
        values = row[:committed].to(torch.int64)
        result = self.insert(key, values, mamba_value=donated, prev_prefix_len=protected, chunked=chunked)
        if result.mamba_exist:
            self.mamba_pool.free(donated)
        self.rebase_on_match(req, self.match_prefix(key), committed)

    # ------------------------------------------------------------------ retraction backups, session accounting

    def backup_request_state(self, req: Req) -> Any:
        """A host copy of the request's own state slot (conv states, temporal state) for a retraction backup."""
        return self.states.backup(req)

    def restore_request_state(self, req: Req, state: Any) -> None:
        """Write a ``backup_request_state`` copy into the state slot the request holds now."""
        self.states.restore(req, state)

    def request_state_slots(self, kv: ReqKvInfo) -> int:
        """State slots the record holds: its own and its ping-pong tracking slots."""
        return self.states.slots_held(kv)

    # ------------------------------------------------------------------ debugging

    def format_tree(self) -> str:
        lines = []
        stack = [(self.root_node, 0)]
        while stack:
            node, indent = stack.pop()
            lines.append(" " * indent + " " + repr(node))
            stack.extend((c, indent + 2) for c in node.children.values())
        states = self.mamba_evictable_size_ + self.mamba_protected_size_
        lines.append(f"#full tokens: {self.total_size()}, #states: {states}")
        return "\n".join(lines)

"""SGLang 0.5.19's ``BasePrefixCache`` over one kvcore backend, and its ``UnifiedRadixCache`` variants.

Each class translates SGLang's params and results, lock results and KV events for the
kvcore backend it holds (``kvcore_cache``), which runs on views of SGLang's own pools.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from sglang.srt.environ import envs  # type: ignore[import-not-found,unused-ignore]
from sglang.srt.mem_cache.base_prefix_cache import (  # type: ignore[import-not-found,unused-ignore]
    BasePrefixCache,
    DecLockRefParams,
    DecLockRefResult,
    EvictParams,
    EvictResult,
    IncLockRefResult,
    InsertParams,
    InsertResult,
    MatchPrefixParams,
    MatchResult,
)
from sglang.srt.mem_cache.common import free_swa_out_of_window_slots  # type: ignore[import-not-found,unused-ignore]

import kvcore
from kvcore_sglang.common.fill_ids import NO_IDS, FillIds, MatchedIds
from kvcore_sglang.common.tree_cache import KvcoreCacheCore
from kvcore_sglang.config import Target
from kvcore_sglang.v0_5_19.events import EventTranslator
from kvcore_sglang.v0_5_19.request_views import ReqView, UnifiedSWAReqView, fill_len, skip_ids

__all__ = ["KvcoreTreeCache", "KvcoreUnifiedMambaTreeCache", "KvcoreUnifiedSWATreeCache", "KvcoreUnifiedTreeCache"]


class KvcoreTreeCache(KvcoreCacheCore, BasePrefixCache):
    """SGLang 0.5.19's ``BasePrefixCache`` answered by one kvcore backend (``kvcore_cache``) on SGLang's pools.

    ``req_to_token_pool`` and ``token_to_kv_pool_allocator`` are SGLang's own
    objects (the scheduler and SGLang's ``common.py`` use them); the kvcore
    backend runs on views of the same objects.
    """

    # How this cache's kvcore backend reads SGLang's Req.
    req_view: type[ReqView] = ReqView
    # The InsertParams fields the kvcore backend's insert takes besides key and value (same names as
    # SGLang's), and the InsertResult fields SGLang's counterpart answers besides prefix_len.
    insert_fields: tuple[str, ...] = ()
    insert_answers: tuple[str, ...] = ("last_device_node",)

    def __init__(self, target: Target, kvcore_cache: Any, params: Any):
        super().__init__(target, kvcore_cache, params)
        self.disable_finished_insert = bool(params.disable_finished_insert)
        if target.backend == "radix":
            self.insert_fields = ("priority", "chunked")
        self._events = EventTranslator(self.page_size) if params.enable_kv_cache_events else None
        if self._events is not None:
            # SGLang's RadixCache records a clear when it builds its (empty) tree.
            self._events.recorder.record_all_cleared()

    # -- traits (disable, root_node: KvcoreCacheCore)
    def is_chunk_cache(self) -> bool:
        return bool(self.kvcore_cache.is_chunk_cache())

    # -- lookups (the key: KvcoreCacheCore._key)
    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        key = self._key(params.key)
        found = self.kvcore_cache.match_prefix(key)
        self._note_matched(params, key)
        node = found.last_device_node
        return MatchResult(device_indices=found.device_indices, last_device_node=node, last_host_node=node,
                           best_match_node=node)

    def _note_matched(self, params: MatchPrefixParams, key: kvcore.RadixKey) -> None:
        """Keep the list the match made of a request's ids (:class:`MatchedIds`) for its cache calls."""
        req = params.req
        if req is not None and key.validated and not self.is_chunk_cache():
            # A tree reads the key as a list to match it, so token_ids is that list here (no conversion).
            self._tables.matched = MatchedIds(req, params.key.token_ids, key.token_ids)

    def reset(self) -> None:
        self.kvcore_cache.reset()
        self._flush_events()

    def insert(self, params: InsertParams) -> InsertResult:
        """SGLang's ``insert``: cache ``params.value`` (KV slots) under ``params.key``; answers what was cached already.

        As SGLang's trees do, the key is cut to whole pages and the value to the key, and a
        disabled cache inserts nothing.  Who frees the caller's slots of the part cached already
        is as in SGLang's counterpart: the caller for ``RadixCache``; the insert itself for
        ``UnifiedRadixCache`` (past ``prev_prefix_len``).  ``value=None`` takes the token
        ids as values (SGLang's fallback for a tree without pools): only a radix tree or a tree
        built without an allocator accepts it.
        """
        if self.disable:
            return InsertResult(prefix_len=0)
        key = self._key(params.key)
        n = len(key) - len(key) % self.page_size
        if n < len(key):
            key = kvcore.RadixKey(key.token_ids[:n], key.extra_key)
        value = params.value
        if value is None:
            if self.token_to_kv_pool_allocator is not None and self.target.backend != "radix":
                raise ValueError(
                    f"{self.target.name}: insert(InsertParams(value=None)) takes the token ids as KV slots, which "
                    "only a tree without pools may do; pass the slots the key's KV is in as value")
        else:
            value = value[:n]
        options = {name: getattr(params, name) for name in self.insert_fields}
        if "priority" in options:
            options["priority"] = int(options["priority"] or 0)
        done = self.kvcore_cache.insert(key, value, **options)
        self._flush_events()
        answers = {name: getattr(done, name) for name in self.insert_answers}
        return InsertResult(prefix_len=int(done.prefix_len), **answers)

    # -- request lifecycle (through the kvcore cache's hook relay, so extension plugins see them)
    def cache_finished_req(self, req: Any, is_insert: bool = True, *, kv_len_to_handle: int, **kwargs: Any) -> None:
        if kwargs:
            raise TypeError(f"{self.target.name}: cache_finished_req got unknown arguments {sorted(kwargs)}")
        if self.disable_finished_insert:
            is_insert = False
        # SGLang caches (origin_input_ids + output_ids)[:kv_len_to_handle]; kvcore reads only what it inserts.
        known = self._tables.known_ids(req, keep=False)
        fill = FillIds((req.origin_input_ids, req.output_ids), kv_len_to_handle, known)
        view = self.req_view(req, fill, kv_len_to_handle, self._tables)
        self.kvcore_cache.hook.cache_finished_req(req=view, is_insert=is_insert)
        self._flush_events()

    def cache_unfinished_req(self, req: Any, chunked: bool = False, **kwargs: Any) -> None:
        if kwargs:
            raise TypeError(f"{self.target.name}: cache_unfinished_req got unknown arguments {sorted(kwargs)}")
        if self.is_chunk_cache():
            # SGLang's ChunkCache keeps the row up to the chunk's end as the prefix.
            fill = NO_IDS
            committed = req.extend_range.end
        else:
            # SGLang caches req.get_fill_ids() (full_untruncated_fill_ids[:extend_range.end], a copy of the
            # whole prefix per chunk); kvcore reads only what it inserts, from the arrays themselves.
            committed = fill_len(req)
            fill = FillIds((req.full_untruncated_fill_ids,), committed, self._tables.known_ids(req, keep=chunked))
        view = self.req_view(req, fill, committed, self._tables)
        self.kvcore_cache.hook.cache_unfinished_req(req=view, chunked=chunked)
        self._flush_events()

    # -- eviction, locks and sizes: KvcoreCacheCore

    # -- KV events
    def take_events(self) -> list:
        return [] if self._events is None else self._events.take()

    def _flush_events(self) -> None:
        if self._events is not None:
            self._events.feed(self.kvcore_cache.take_events())


class KvcoreUnifiedTreeCache(KvcoreTreeCache):
    """SGLang 0.5.19's ``UnifiedRadixCache`` answered by kvcore's one tree; here its one component is full.

    What SGLang's unified tree answers whatever its components: a disabled tree is a chunk
    cache; ``insert`` takes every component's fields and answers the last node and
    ``mamba_exist``; ``inc_lock_ref`` reports the full tokens it newly protected (its full
    component's delta; SGLang's RadixCache reports the change in evictable tokens), the window
    lock's stop and the tombstones it passed over (none without a swa component);
    ``dec_lock_ref`` aggregates no delta; eviction takes every component's target and counts
    full tokens only in its metrics; the full pool's sizes and ``total_size() -> (full tokens,
    the other components' slots)``.  The hybrid models' component sets add their contracts
    (:class:`KvcoreUnifiedSWATreeCache`, :class:`KvcoreUnifiedMambaTreeCache`).
    """

    insert_fields: tuple[str, ...] = ("prev_prefix_len", "swa_evicted_seqlen", "mamba_value", "chunked", "priority")
    insert_answers: tuple[str, ...] = ("last_device_node", "mamba_exist")

    def is_chunk_cache(self) -> bool:
        # Disabled, SGLang's UnifiedRadixCache calls itself a chunk cache (its RadixCache does not).
        return self.disable or super().is_chunk_cache()

    # -- eviction and locks
    def evict(self, params: EvictParams) -> EvictResult:
        start = time.perf_counter()
        done = self.kvcore_cache.evict(params.num_tokens, swa_num_tokens=params.swa_num_tokens,
                                       mamba_num=params.mamba_num)
        full = done.num_tokens_evicted
        self.update_eviction_metrics(full, start)
        self._flush_events()
        return EvictResult(num_tokens_evicted=full, swa_num_tokens_evicted=done.swa_num_tokens_evicted,
                           mamba_num_evicted=done.mamba_num_evicted)

    def inc_lock_ref(self, node: Any) -> IncLockRefResult:
        if self.disable:
            return IncLockRefResult()
        lock = self.kvcore_cache.inc_lock_ref(node)
        return IncLockRefResult(delta=lock.delta, swa_uuid_for_lock=lock.stop, skip_lock_node_ids=skip_ids(lock))

    def dec_lock_ref(self, node: Any, params: DecLockRefParams | None = None) -> DecLockRefResult:
        # SGLang's unified tree core aggregates no delta here ("no caller uses it yet").
        self.kvcore_cache.dec_lock_ref(node)
        return DecLockRefResult()

    # -- sizes
    def full_evictable_size(self) -> int:
        return int(self.kvcore_cache.full_evictable_size())

    def full_protected_size(self) -> int:
        return int(self.kvcore_cache.full_protected_size())

    def total_size(self) -> Any:
        return int(self.kvcore_cache.total_size()), self._other_total_size()

    def _other_total_size(self) -> int:
        """The slots the components other than full hold (none here)."""
        return 0

    # -- what SGLang's leak diagnosis (the scheduler's watchdog dump) reads
    def all_values_flatten(self) -> torch.Tensor:
        return self._tree_slots("full")

    def all_mamba_values_flatten(self) -> torch.Tensor:
        return self._tree_slots("mamba")

    def _tree_slots(self, pool: str) -> torch.Tensor:
        parts = [owned.slots.reshape(-1) for owned in self.kvcore_cache.iter_owned_slots() if owned.pool == pool]
        return torch.cat(parts) if parts else torch.tensor([], dtype=torch.int64, device=self.device)

    def available_and_evictable_str(self) -> str:
        alloc = self.token_to_kv_pool_allocator
        full = alloc.full_available_size() if self.supports_swa() else alloc.available_size()
        full_ev = self.full_evictable_size()
        lines = [f"Available full tokens: {full + full_ev} (full_available_size={full} + "
                 f"full_evictable_size_={full_ev})"]
        for name, available, evictable in self._other_availability():
            lines.append(f"Available {name}: {available + evictable} (available_size={available} + "
                         f"component_evictable_size_={evictable})")
        return "\n".join(lines) + "\n"

    def _other_availability(self) -> list[tuple[str, int, int]]:
        """(component, free slots, evictable slots) of each component other than full (none here)."""
        return []


class KvcoreUnifiedSWATreeCache(KvcoreUnifiedTreeCache):
    """SGLang 0.5.19's ``UnifiedRadixCache`` with components full + swa (a hybrid SWA model).

    ``kvcore-swa`` and ``kvcore-unified`` build the same tree here.  On top of the unified
    answers: the window (``supports_swa``, ``sliding_window_size``), the window sizes and
    ``total_size() -> (full, swa)``, SGLang's window lock handles (``swa_uuid_for_lock`` and the
    skipped tombstones, back to ``dec_lock_ref`` through ``DecLockRefParams`` or the request's
    fields, and ``skip_swa``), ``dec_swa_lock_only`` and two-pool eviction; the plain sizes are
    the full pool's, and ``cache_unfinished_req`` first frees what left the request's window
    (``SGLANG_OPT_UNIFIED_CACHE_FREE_OUT_OF_WINDOW_SLOTS``, on by default in 0.5.19).
    """

    req_view: type[UnifiedSWAReqView] = UnifiedSWAReqView

    def __init__(self, target: Target, kvcore_cache: Any, params: Any):
        super().__init__(target, kvcore_cache, params)
        self.sliding_window_size = int(kvcore_cache.sliding_window_size)

    def supports_swa(self) -> bool:
        return True

    def cache_unfinished_req(self, req: Any, chunked: bool = False, **kwargs: Any) -> None:
        if not self.disable and envs.SGLANG_OPT_UNIFIED_CACHE_FREE_OUT_OF_WINDOW_SLOTS.get():
            # SGLang's unified swa component, before its insert: the frontier a page below the insert's end.
            free_swa_out_of_window_slots(
                req, fill_len(req) - 1, sliding_window_size=self.sliding_window_size,
                page_size=self.page_size, req_to_token_pool=self.req_to_token_pool,
                token_to_kv_pool_allocator=self.token_to_kv_pool_allocator, retain_floor=self.swa_retain_floor(req),
            )
        super().cache_unfinished_req(req, chunked, **kwargs)

    # -- locks
    def dec_lock_ref(self, node: Any, params: DecLockRefParams | None = None, skip_swa: bool = False
                     ) -> DecLockRefResult:
        lock = (self.req_view.lock_from(None, swa_released=skip_swa) if params is None else
                self.req_view.lock_from(params.swa_uuid_for_lock, params.skip_lock_node_ids, skip_swa))
        self.kvcore_cache.dec_lock_ref(node, lock)
        return DecLockRefResult()

    def dec_swa_lock_only(self, node: Any, swa_uuid_for_lock: int | None = None,
                          skip_lock_node_ids: Any = None) -> None:
        self.kvcore_cache.dec_swa_lock_only(node, self.req_view.lock_from(swa_uuid_for_lock, skip_lock_node_ids))

    # -- sizes (full_*: KvcoreUnifiedTreeCache)
    def swa_evictable_size(self) -> int:
        return int(self.kvcore_cache.swa_evictable_size())

    def swa_protected_size(self) -> int:
        return int(self.kvcore_cache.swa_protected_size())

    def _other_total_size(self) -> int:
        return int(self.kvcore_cache.swa_total_size())

    def _other_availability(self) -> list[tuple[str, int, int]]:
        return [("swa", int(self.token_to_kv_pool_allocator.swa_available_size()), self.swa_evictable_size())]


class KvcoreUnifiedMambaTreeCache(KvcoreUnifiedTreeCache):
    """SGLang 0.5.19's ``UnifiedRadixCache`` with components full + mamba (a hybrid SSM model).

    ``kvcore-mamba`` and ``kvcore-unified`` build the same tree here, on SGLang's
    ``HybridReqToTokenPool``.  On top of the unified answers: ``supports_mamba``, the admission
    match's copy-on-write (``MatchPrefixParams.cow_mamba`` with ``req``: a state slot for the
    request and ``mamba_cow_src_index`` on its record, copied by the forward) and
    ``mamba_branching_seqlen``, two-pool eviction (``EvictParams.mamba_num``), the mamba sizes
    and ``total_size() -> (full tokens, states)``.  The request's state fields are SGLang's own
    ``ReqKvInfo`` fields, read and written by the kvcore tree through :class:`MambaStateView`.
    """

    def supports_mamba(self) -> bool:
        return True

    def cache_finished_req(self, req: Any, is_insert: bool = True, *, kv_len_to_handle: int, **kwargs: Any) -> None:
        slot = req.kv.mamba_pool_idx
        super().cache_finished_req(req, is_insert, kv_len_to_handle=kv_len_to_handle, **kwargs)
        if slot is not None and req.kv.mamba_pool_idx is None and self._tree_took(slot):
            # SGLang's tree donates a finished request's state slot to the tree and leaves it on the
            # request's record (nothing frees it from there: the request is done; the tree owns the slot).
            # kvcore's record drops it; SGLang's scheduler and its checks read SGLang's.
            req.kv.mamba_pool_idx = slot

    def _tree_took(self, slot: torch.Tensor) -> bool:
        """Whether state slot ``slot`` is held now (not on SGLang's free list): the tree kept it."""
        free = self.req_to_token_pool.mamba_allocator.free_slots
        return not bool((free == slot.reshape(-1)[0]).any())

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        req = params.req
        cow = bool(params.cow_mamba) and req is not None
        # SGLang's scheduler matches a waiting request again each round; one that kept its state
        # slot from an earlier match is only pointed at the new source (SGLang's match does that).
        rematch = cow and bool(req.kv.holds_mamba)
        view = self.req_view(req, NO_IDS, None, self._tables) if cow and not rematch else None
        key = self._key(params.key)
        found = self.kvcore_cache.match_prefix(key, cow_mamba=view is not None, req=view)
        self._note_matched(params, key)
        node = found.last_device_node
        if rematch and node.mamba_value is not None:
            req.kv.mamba_cow_src_index = node.mamba_value
            req.kv.mamba_needs_clear = False
        return MatchResult(device_indices=found.device_indices, last_device_node=node, last_host_node=node,
                           best_match_node=node, mamba_branching_seqlen=found.mamba_branching_seqlen)

    # -- sizes (full_*: KvcoreUnifiedTreeCache)
    def mamba_evictable_size(self) -> int:
        return int(self.kvcore_cache.mamba_evictable_size())

    def mamba_protected_size(self) -> int:
        return int(self.kvcore_cache.mamba_protected_size())

    def _other_total_size(self) -> int:
        return self.mamba_evictable_size() + self.mamba_protected_size()

    def _other_availability(self) -> list[tuple[str, int, int]]:
        return [("mamba", int(self.req_to_token_pool.mamba_allocator.available_size()), self.mamba_evictable_size())]

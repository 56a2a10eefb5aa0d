"""SGLang 0.5.23's ``BasePrefixCache`` over one kvcore backend.

SGLang 0.5.23's contract, where it differs from 0.5.19's:

* ``checkpoint(req, *, up_to)`` is the one insert (a chunk, and once more at the finish):
  insert ``[0, up_to)``, free the duplicates, repoint the row onto the tree's copy, move
  ``req.lock`` onto the node the insert ended on and advance ``cache_protected_len``.  It
  frees nothing else: ``common.release_kv_cache`` frees the tail, unlocks and gives the
  row back itself, through :meth:`free_kv_row` and :meth:`unlock`.
* a match answers ``device_prefix_len``; the slots are read off the tree
  (:meth:`path_device_indices`, ``prefix_device_indices``).
* locks live on the request (``req.lock``, a ``TreeLock`` from :meth:`lock`).
* ``supports_prefix_sharing()`` replaces ``is_chunk_cache()``.
* SGLang's ``RadixCache`` splits a finished request's leaf at the prompt boundary
  (``split_prompt``: the prompt part one priority higher) and counts a node's hit only
  once per request (``cache_inserted_len``); both are done here as SGLang does them.
"""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.mem_cache.base_prefix_cache import (  # type: ignore[import-not-found,unused-ignore]
    BasePrefixCache,
    DecLockRefParams,
    DecLockRefResult,
    EvictParams,
    EvictResult,
    IncLockRefResult,
    MatchPrefixParams,
    MatchResult,
    TreeLock,
)
from sglang.srt.mem_cache.common import coalesce_ranges  # type: ignore[import-not-found,unused-ignore]

import kvcore
from kvcore_sglang.common.build import UnsupportedContext
from kvcore_sglang.common.fill_ids import FillIds, MatchedIds, RequestTables
from kvcore_sglang.common.pool_views import AllocatorView
from kvcore_sglang.common.tree_cache import KvcoreCacheCore
from kvcore_sglang.config import Target
from kvcore_sglang.v0_5_23.events import EventTranslator
from kvcore_sglang.v0_5_23.request_views import KvRecordView023, ReqView023, tree_lock
from kvcore_sglang.v0_5_23.version import SGLANG_VERSION

__all__ = ["KvcoreChunkCache", "KvcoreTreeCache", "KvcoreUnifiedTreeCache"]

_INT64_MAX = torch.iinfo(torch.int64).max


class _NoTree:
    """The root a cache without a tree hands out as every match's node (it has no children to walk)."""

    children: dict = {}

    def __repr__(self) -> str:
        return "<no tree>"


class KvcoreTreeCache(KvcoreCacheCore, BasePrefixCache):
    """SGLang 0.5.23's ``BasePrefixCache`` answered by one kvcore tree backend (``kvcore_cache``) on SGLang's pools.

    ``req_to_token_pool`` and ``token_to_kv_pool_allocator`` are SGLang's own objects;
    the kvcore backend runs on views of the same objects.
    """

    def __init__(self, target: Target, kvcore_cache: Any, params: Any):
        super().__init__(target, kvcore_cache, params)
        self._empty = torch.empty((0,), dtype=torch.int64, device=self.device)
        # SGLang's trees publish nothing while disabled, and record a clear when they build the tree.
        self._events = EventTranslator(params, enabled=bool(params.enable_kv_cache_events) and not self.disable)
        self._events.recorder.record_all_cleared()
        # kvcore's tree protocol inserts (key, value); kvcore-radix also takes SGLang's priority and chunked.
        self._insert_options = target.backend == "radix"

    # -- traits (disable, root_node: KvcoreCacheCore)
    def supports_prefix_sharing(self) -> bool:
        return not self.disable

    # -- lookups
    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        key = self._key(params.key)
        found = self.kvcore_cache.match_prefix(key)
        req = params.req
        if req is not None and key.validated and not self.disable:
            # A tree reads the key as a list to match it, so token_ids is that list here (no conversion).
            self._tables.matched = MatchedIds(req, params.key.token_ids, key.token_ids)
        node = found.last_device_node
        if node is None:
            node = self.root_node
        return MatchResult(device_prefix_len=found.prefix_len, last_device_node=node, last_host_node=node,
                           best_match_node=node)

    def touch_prefix(self, key: Any) -> None:
        # SGLang's touch is its match's walk (the access times, a split where the key ends mid-node).
        if not self.disable:
            self.kvcore_cache.match_prefix(self._key(key))

    def path_device_indices(self, node: Any) -> torch.Tensor:
        values = []
        root = self.root_node
        while node is not None and node is not root:
            values.append(node.value)
            node = node.parent
        if not values:
            return self._empty
        values.reverse()
        return torch.cat(values)

    def reset(self) -> None:
        self.kvcore_cache.reset()
        self._tables = RequestTables()

    # -- request lifecycle (through the kvcore cache's hook relay, so extension plugins see them)
    def checkpoint(self, req: Any, *, up_to: int, **kwargs: Any) -> None:
        if kwargs:
            raise TypeError(f"{self.target.name}: checkpoint got unknown arguments {sorted(kwargs)}")
        if self.disable:
            return
        kv = req.kv
        if kv.swa_evict_floor:
            # SGLang's pure-SWA key limit; no kvcore name serves a windowed model on SGLang 0.5.23.
            raise UnsupportedContext(f"{self.target.name} (SGLang {SGLANG_VERSION}): request {req.rid!r} has a "
                                     f"window eviction floor ({kv.swa_evict_floor}); windowed models are not served")
        inserted = int(kv.cache_inserted_len)
        known = self._tables.known_ids(req, keep=not req.finished())
        fill = FillIds((req.full_untruncated_fill_ids,), up_to, known)
        view = ReqView023(req, fill, up_to, self._tables)
        # chunked: kvcore counts no hit; SGLang's once-per-request rule is applied below.
        self.kvcore_cache.hook.cache_unfinished_req(req=view, chunked=True)
        view.settle_lock()
        key_len = up_to // self.page_size * self.page_size
        self._count_hits(req.last_node, key_len, inserted)
        self._split_at_prompt(req, view, key_len)
        kv.cache_inserted_len = max(inserted, key_len)

    def _count_hits(self, node: Any, end: int, inserted: int) -> None:
        """SGLang's hit count of an insert of ``[0, end)``: one per node on the path that ends past ``inserted``."""
        root = self.root_node
        while node is not None and node is not root and end > inserted:
            node.hit_count += 1
            end -= len(node.key)
            node = node.parent

    def _split_at_prompt(self, req: Any, view: ReqView023, key_len: int) -> None:
        """SGLang's ``split_prompt``: the prompt's whole pages become their own node, one priority higher."""
        ps = self.page_size
        prompt = len(req.origin_input_ids) // ps * ps
        if not 0 < prompt < key_len:
            return
        row = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :prompt].to(torch.int64)
        key = kvcore.RadixKey(view.fill_slice(0, prompt), view.extra_key)
        self._insert_prompt(key, row, min(view.priority + 1, _INT64_MAX))

    def _insert_prompt(self, key: kvcore.RadixKey, row: torch.Tensor, priority: int) -> None:
        """The split's insert of the prompt's whole pages (already in the tree, on the row's slots)."""
        if self._insert_options:
            self.kvcore_cache.insert(key, row, priority=priority, chunked=True)
        else:
            # The split alone: a node's priority orders only the priority eviction policy, kvcore-radix's.
            self.kvcore_cache.insert(key, row)

    def free_kv_row(self, kv: Any, ranges: list[tuple[int, int]]) -> None:
        # Through kvcore (strict: a slot a node owns is refused before SGLang frees anything); adjacent
        # pieces merged first, as SGLang's, so a page split between two is freed once.
        self.kvcore_cache.free_kv_row(KvRecordView023(kv), coalesce_ranges(ranges))

    def on_release(self, req: Any, *, checkpointed: bool) -> None:
        self._tables.ids.pop(req, None)

    # -- SGLang's lock objects on the request (eviction, inc/dec_lock_ref and the sizes: KvcoreCacheCore)
    def lock(self, node: Any) -> TreeLock | None:
        return tree_lock(node, self.kvcore_cache.inc_lock_ref(node))

    def unlock(self, lock: TreeLock | None) -> None:
        if lock is not None:
            self.kvcore_cache.dec_lock_ref(lock.node, lock.kvcore)

    def all_values_flatten(self) -> torch.Tensor:
        """Every slot the tree holds (SGLang's leak diagnosis reads it)."""
        parts = [owned.slots.reshape(-1) for owned in self.kvcore_cache.iter_owned_slots() if owned.pool == "full"]
        return torch.cat(parts) if parts else self._empty

    # -- KV events
    def take_events(self) -> list:
        self._events.feed(self.kvcore_cache.take_events())
        return self._events.take()


class KvcoreUnifiedTreeCache(KvcoreTreeCache):
    """SGLang 0.5.23's ``UnifiedRadixCache`` with its one component full (a full-attention model), over kvcore's
    ``unified`` tree (component ``full``).

    Where SGLang's unified tree answers otherwise than its ``RadixCache``: ``total_size`` is a
    pair (full tokens, tokens of the other components: none here), and its prompt split is an
    insert that frees the caller's duplicates from ``prev_prefix_len`` on, so it passes the
    prompt's page-aligned length there (``[0, prompt)`` is the tree's own slots, not duplicates)
    with ``inserted_len`` the same length (no hit counted) and the priority one higher.
    """

    def _insert_prompt(self, key: kvcore.RadixKey, row: torch.Tensor, priority: int) -> None:
        self.kvcore_cache.insert(key, row, prev_prefix_len=len(row), chunked=True, priority=priority)

    def total_size(self) -> Any:
        return int(self.kvcore_cache.total_size()), 0

    def evict(self, params: EvictParams) -> EvictResult:
        # SGLang 0.5.23's full component frees each evicted node as a page-exact segment; every free of
        # kvcore's eviction is of an evicted node's value.  (At page 1 both orders are the same.)
        alloc = self.kvcore_cache.token_to_kv_pool_allocator
        if self.page_size == 1 or not isinstance(alloc, AllocatorView):
            return super().evict(params)
        with alloc.frees_as_segments():
            return super().evict(params)


class KvcoreChunkCache(KvcoreTreeCache):
    """SGLang 0.5.23's cache without prefix sharing (what ``--disable-radix-cache`` builds) over kvcore's ``chunk``.

    Nothing is matched, locked or inserted; a request's row is freed whole by SGLang's
    ``release_kv_cache`` through :meth:`free_kv_row` (kvcore's, on SGLang's allocator).
    """

    _root = _NoTree()

    @property
    def root_node(self) -> Any:
        return self._root

    def lock(self, node: Any) -> TreeLock | None:
        return tree_lock(node, None)

    def unlock(self, lock: TreeLock | None) -> None:
        pass

    def inc_lock_ref(self, node: Any) -> IncLockRefResult:
        return IncLockRefResult()

    def dec_lock_ref(self, node: Any, params: DecLockRefParams | None = None) -> DecLockRefResult:
        return DecLockRefResult()

    def total_size(self) -> Any:
        return 0

"""Pure-SWA backends: models whose every attention layer is sliding-window (SGLang's PureSWA classes).

``swa-pure``       :class:`PureSWARadixCache`, SGLang's ``PureSWARadixCache``.
``swa-pure-chunk`` :class:`PureSWAChunkCache`, SGLang's ``PureSWAChunkCache``.

Pools.  SGLang gives such a model (``full_max_total_num_tokens == 0``) a
``PureSWATokenToKVPoolAllocator``: one pool, whose window free releases the slot
itself and whose ``free_full`` does nothing (there is no full side).  kvcore's is
:class:`PureSWATokenToKVPoolAllocator`, a :class:`kvcore.pools.TokenToKVPoolAllocator`
whose single pool is listed as ``full`` (the pool the req_to_token row indexes,
as for every kvcore backend) with ``windowed=True``: the invariant checker and the
bench then count a running record's window-freed range ``[swa_dead_lo,
swa_evicted_seqlen)`` as gone.  The window free is the core's
(``free_swa_out_of_window_slots``), unchanged: a tree cache keeps
``max(window, page)`` tokens, a chunk cache exactly the window, never below
``swa_dead_lo``, so ``swa_evict_floor`` (prefill-aware SWA) protects a prompt's KV
for the whole decode.  Unlike SGLang's allocator, page sizes above 1 work.

Why the tree cache composes the core tree.  SGLang's ``PureSWARadixCache``
subclasses ``RadixCache`` and changes only what a finished request inserts (its
prefix below the evict floor), the ``evict`` arguments and the size names.  kvcore
has one tree, :class:`kvcore.tree.unified.UnifiedRadixCache`; ``radix`` is its
component set ``("full",)`` with RadixCache's answers
(:class:`kvcore.tree.unified_config.RadixTreeConfig`).  This class builds that same
tree on its one pool (no window component: a pure-SWA model's single pool is the
row's, so the tree's tombstones and window locks have nothing to do) and delegates
to it, adding only the finishing rule and the SWA size names.  It needs no other
backend installed.

Finishing rule (both backends): a request's row ``[cache_protected_len,
kv_committed_len)`` is given back except ``[swa_dead_lo, swa_evicted_seqlen)``,
which the window free already returned; the tree cache first inserts
``[0, insert_end)`` with ``insert_end`` the page-aligned committed length,
capped at the page-rounded ``swa_evict_floor`` when one is set (SGLang), and at
``swa_dead_lo`` once the window cursor passed it: positions the window freed are
never inserted.  Contract differences with SGLang 0.5.19 (docs/CONTRACT-NOTES.md):
SGLang inserts the whole committed key when the floor is 0 even after the window
freed part of it (the tree then holds free slots), and its ``is_insert=False``
path leaks ``[floor, committed)`` when no window free ran yet; kvcore does neither.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from kvcore.cache import BasePrefixCache, EvictResult, InsertResult, LockResult, MatchResult, SlotOwner
from kvcore.config import CacheInitParams, TreeCacheConfig
from kvcore.keys import KeyLike
from kvcore.pool_builder import Placement, PoolBuilder
from kvcore.pools.allocator import TokenToKVPoolAllocator, split_row_segments
from kvcore.pools.views import PoolView
from kvcore.record import ceil_align, floor_align
from kvcore.tree import check_evict_count
from kvcore.tree.unified import UnifiedNode, UnifiedRadixCache
from kvcore.tree.unified_config import RadixTreeConfig
from kvcore_swa.chunk import SWAChunkCache
from kvcore_swa.config import SlidingWindowConfig
from kvcore_swa.window import SlidingWindowMixin, window_size

if TYPE_CHECKING:
    from kvcore.record import Req

__all__ = [
    "PureSWAChunkCache",
    "PureSWAChunkConfig",
    "PureSWAConfig",
    "PureSWARadixCache",
    "PureSWATokenToKVPoolAllocator",
]

class PureSWATokenToKVPoolAllocator(TokenToKVPoolAllocator):
    """One pool for a model whose every layer is sliding-window (SGLang's ``PureSWATokenToKVPoolAllocator``).

    The SWA allocator's names over a single pool: ``free_swa`` releases the slots
    (the window side is all there is), ``free_full`` releases nothing, both
    available sizes are the pool's, and a row's window-freed range is skipped when
    the row is given back.
    """

    @property
    def size_full(self) -> int:
        return self.size

    @property
    def size_swa(self) -> int:
        return self.size

    def full_available_size(self) -> int:
        return self.available_size()

    def swa_available_size(self) -> int:
        return self.available_size()

    def full_free_slots(self) -> torch.Tensor:
        return self.free_slots()

    def swa_free_slots(self) -> torch.Tensor:
        return self.free_slots()

    def translate_loc_from_full_to_swa(self, indices: Any) -> torch.Tensor:
        """The identity: a slot is its own window slot."""
        return self.as_slots(indices)

    def free_swa(self, free_index: Any) -> None:
        """The window free: the slots go back to the pool."""
        self.free(free_index)

    def free_full(self, free_index: Any) -> None:
        """No full side: nothing to give back (SGLang's rule); the slots are only range-checked."""
        self.check_in_range(self.as_slots(free_index))

    def free_row_segments(
        self, segments: Sequence[tuple[torch.Tensor, int]], *, swa_evicted_seqlen: int = 0, swa_dead_lo: int = 0
    ) -> None:
        """Free a row's pieces except ``[swa_dead_lo, swa_evicted_seqlen)``, which the window free returned."""
        dead, alive = split_row_segments(segments, dead_lo=swa_dead_lo, dead_hi=swa_evicted_seqlen)
        if dead and alive and swa_evicted_seqlen % self.page_size:
            raise ValueError(f"window cursor {swa_evicted_seqlen} splits a page (page_size {self.page_size})")
        if alive:
            self.free_segments(alive)

    def pool_views(self) -> list[PoolView]:
        """One pool, ``full`` (the row indexes it), windowed: a record's window-freed range is not its own."""
        return [PoolView("full", self, windowed=True)]


class PureSWAChunkConfig(SlidingWindowConfig):
    """Options of ``swa-pure-chunk``: the common options (``size`` is the one pool) and ``sliding_window_size``."""


class PureSWAPools(PoolBuilder[PureSWAChunkConfig]):
    """The pools of ``swa-pure`` and ``swa-pure-chunk``: one window pool (PureSWATokenToKVPoolAllocator)."""

    def allocator(self, config: PureSWAChunkConfig, at: Placement) -> PureSWATokenToKVPoolAllocator:
        return PureSWATokenToKVPoolAllocator(config.size, config.page_size, at.torch_device)


class PureSWAConfig(TreeCacheConfig, PureSWAChunkConfig):
    """Options of ``swa-pure``: the window and the tree's options (every eviction policy, as ``radix``)."""


def _require_pure(allocator: Any, backend: str) -> PureSWATokenToKVPoolAllocator:
    if not isinstance(allocator, PureSWATokenToKVPoolAllocator):
        raise TypeError(
            f"{backend} needs a PureSWATokenToKVPoolAllocator (one pool, every layer sliding-window), "
            f"got {type(allocator).__name__}; build it with kvcore.create_cache"
        )
    return allocator


class PureSWAChunkCache(SWAChunkCache):
    """SGLang's ``PureSWAChunkCache``: ``swa-chunk`` on the one-pool allocator.

    The inherited finish gives back ``[cache_protected_len, kv_committed_len)``
    through the allocator, which skips the window-freed ``[swa_dead_lo,
    swa_evicted_seqlen)``: SGLang's rule, written there once.
    """

    token_to_kv_pool_allocator: PureSWATokenToKVPoolAllocator  # type: ignore[assignment]

    def __init__(self, params: CacheInitParams, sliding_window_size: int | None = None):
        _require_pure(params.token_to_kv_pool_allocator, "PureSWAChunkCache")
        super().__init__(params, sliding_window_size)

    def cached_sizes(self) -> dict[str, tuple[int, int]]:
        return {"full": (0, 0)}


class PureSWARadixCache(SlidingWindowMixin, BasePrefixCache[UnifiedNode]):
    """SGLang's ``PureSWARadixCache``: the core tree with RadixCache's answers, a window, and the floor-bounded finish.

    ``self.tree`` is that tree (:class:`kvcore.tree.unified.UnifiedRadixCache` on a
    :class:`kvcore.tree.unified_config.RadixTreeConfig`, as ``radix`` builds it) on the
    same pools; every tree call is delegated to it.  Sizes use SGLang's names: the ``swa_`` sizes are the
    tree's, the ``full_`` ones are 0.
    """

    token_to_kv_pool_allocator: PureSWATokenToKVPoolAllocator  # type: ignore[assignment]

    def __init__(self, params: CacheInitParams, sliding_window_size: int | None = None):
        alloc = _require_pure(params.token_to_kv_pool_allocator, "PureSWARadixCache")
        self.sliding_window_size = window_size(params.config, sliding_window_size)
        fields = RadixTreeConfig.model_fields
        options = {k: v for k, v in params.config.model_dump().items() if k in fields}
        self.tree: BasePrefixCache[UnifiedNode] = UnifiedRadixCache(
            CacheInitParams(
                req_to_token_pool=params.req_to_token_pool,
                token_to_kv_pool_allocator=alloc,
                page_size=params.page_size,
                config=RadixTreeConfig(**options),
                kv_pool=params.kv_pool,
            )
        )
        super().__init__(params)
        self.token_to_kv_pool_allocator = alloc
        self.device = torch.device(alloc.device)

    # ------------------------------------------------------------------ the tree, delegated

    @property
    def root_node(self) -> Any:
        return self.tree.root_node

    @property
    def disable(self) -> bool:  # type: ignore[override]
        return self.tree.disable

    def check_node_locked(self, node: UnifiedNode, what: str) -> None:
        self.tree.check_node_locked(node, what)

    def match_prefix(self, key: KeyLike) -> MatchResult:
        return self.tree.match_prefix(key)

    def insert(self, key: KeyLike, value: torch.Tensor | None = None, **kwargs: int) -> InsertResult:
        return self.tree.insert(key, value, **kwargs)

    def inc_lock_ref(self, node: UnifiedNode) -> LockResult:
        return self.tree.inc_lock_ref(node)

    def dec_lock_ref(self, node: UnifiedNode, lock: LockResult | None = None) -> LockResult:
        return self.tree.dec_lock_ref(node, lock)

    def evictable_size(self) -> int:
        return self.tree.evictable_size()

    def protected_size(self) -> int:
        return self.tree.protected_size()

    def total_size(self) -> int:
        return self.tree.total_size()

    def reset(self) -> None:
        self.tree.reset()

    def take_events(self) -> list:
        return self.tree.take_events()

    def iter_owned_slots(self) -> Iterator[SlotOwner]:
        return self.tree.iter_owned_slots()

    def sanity_check(self) -> None:
        self.tree.sanity_check()

    def format_tree(self) -> str:
        return self.tree.format_tree()

    # ------------------------------------------------------------------ SWA names

    def evict(self, num_tokens: int, swa_num_tokens: int = 0) -> EvictResult:
        """SGLang's rule: the larger count (its scheduler asks with ``swa_num_tokens``); one pool frees both."""
        num_tokens = check_evict_count(num_tokens)
        swa_num_tokens = check_evict_count(swa_num_tokens, "swa_num_tokens")
        n = self.tree.evict(max(num_tokens, swa_num_tokens)).num_tokens_evicted
        return EvictResult(num_tokens_evicted=n, swa_num_tokens_evicted=n)

    def full_evictable_size(self) -> int:
        return 0

    def full_protected_size(self) -> int:
        return 0

    def swa_evictable_size(self) -> int:
        return self.tree.evictable_size()

    def swa_protected_size(self) -> int:
        return self.tree.protected_size()

    def cached_sizes(self) -> dict[str, tuple[int, int]]:
        return {"full": (self.tree.evictable_size(), self.tree.protected_size())}

    # ------------------------------------------------------------------ requests

    def insert_end(self, req: Req) -> int:
        """How much of ``req``'s row a finish may insert (see the module docstring)."""
        kv = req.kv
        ps = self.page_size
        end = floor_align(kv.kv_committed_len, ps)
        if kv.swa_evict_floor > 0:
            end = min(end, ceil_align(kv.swa_evict_floor, ps))
        dead_lo = kv.swa_dead_lo(ps)
        if kv.swa_evicted_seqlen > dead_lo:
            end = min(end, dead_lo)
        return end

    def cache_finished_req(self, req: Req, is_insert: bool = True) -> None:
        self.check_req(req, "cache_finished_req")
        kv = req.kv
        committed = kv.kv_committed_len
        end = self.insert_end(req)
        # The tree finishes the request as if it had committed [0, end) (insert, duplicates,
        # unlock); what lies above is not cached and goes back here, window-freed part excepted.
        kv.kv_committed_len = end
        try:
            self.tree.cache_finished_req(req, is_insert)
        finally:
            kv.kv_committed_len = committed
        lo = max(end, kv.cache_protected_len)
        if committed > lo:
            self.free_kv_row(kv, [(lo, committed)])

    def cache_unfinished_req(self, req: Req, chunked: bool = False) -> None:
        self.check_req(req, "cache_unfinished_req")
        kv = req.kv
        if kv.swa_evicted_seqlen > kv.swa_dead_lo(self.page_size):
            raise ValueError(
                f"request {req.rid!r}: cache_unfinished_req after the window freed "
                f"[{kv.swa_dead_lo(self.page_size)}, {kv.swa_evicted_seqlen}) of its row; a pure-SWA tree caches "
                "a running request only during prefill (nothing was changed)"
            )
        self.tree.cache_unfinished_req(req, chunked)

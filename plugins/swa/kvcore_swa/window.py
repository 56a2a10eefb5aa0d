"""What both SWA backends answer the same way: the window, the two pools' sizes, room and window frees."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvcore.cache import EvictResult
from kvcore.capabilities import Capability
from kvcore.release import free_swa_out_of_window_slots_batch

if TYPE_CHECKING:
    from kvcore.config import CacheConfig
    from kvcore.pools import ReqToTokenPool, SWATokenToKVPoolAllocator
    from kvcore.record import Req

__all__ = ["SlidingWindowMixin", "window_size"]


def window_size(config: CacheConfig, sliding_window_size: int | None) -> int:
    """``sliding_window_size`` if given, else the config's; ValueError unless positive."""
    if sliding_window_size is None:
        from kvcore_swa.config import SlidingWindowConfig

        sliding_window_size = config.sliding_window_size if isinstance(config, SlidingWindowConfig) else None
    if sliding_window_size is None or sliding_window_size <= 0:
        raise ValueError(f"sliding_window_size must be a positive number of tokens, got {sliding_window_size}")
    return int(sliding_window_size)


class SlidingWindowMixin:
    """Pools ``full`` and ``swa``: sizes per pool, ``make_room`` for both, the decode-time window free.

    The host class defines ``sliding_window_size``, ``page_size``, the pools, the
    four ``full_/swa_ evictable/protected`` sizes and ``evict(n, swa_num_tokens)``.
    """

    sliding_window_size: int
    page_size: int
    req_to_token_pool: ReqToTokenPool
    capabilities = frozenset({Capability.WINDOWED})

    if TYPE_CHECKING:

        @property
        def token_to_kv_pool_allocator(self) -> SWATokenToKVPoolAllocator: ...
        def full_evictable_size(self) -> int: ...
        def full_protected_size(self) -> int: ...
        def swa_evictable_size(self) -> int: ...
        def swa_protected_size(self) -> int: ...
        def evict(self, num_tokens: int, swa_num_tokens: int = 0) -> EvictResult: ...
        def is_chunk_cache(self) -> bool: ...

    def cached_sizes(self) -> dict[str, tuple[int, int]]:
        return {
            "full": (self.full_evictable_size(), self.full_protected_size()),
            "swa": (self.swa_evictable_size(), self.swa_protected_size()),
        }

    def make_room(self, num_tokens: int) -> EvictResult:
        """Evict the shortfall of each pool: a new token takes a full and a window slot."""
        alloc = self.token_to_kv_pool_allocator
        short = num_tokens - alloc.full_available_size()
        short_swa = num_tokens - alloc.swa_available_size()
        if short > 0 or short_swa > 0:
            return self.evict(max(short, 0), swa_num_tokens=max(short_swa, 0))
        return EvictResult()

    def free_window_slots(self, reqs: Sequence[Req], pre_lens: Sequence[int] | None = None) -> int:
        """Free the window slots that left each request's window (one free for the batch)."""
        if pre_lens is None:
            pre_lens = [req.kv.kv_allocated_len for req in reqs]
        return free_swa_out_of_window_slots_batch(
            reqs,
            pre_lens,
            sliding_window_size=self.sliding_window_size,
            page_size=self.page_size,
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool_allocator=self.token_to_kv_pool_allocator,
            is_chunk_cache=self.is_chunk_cache(),
        )

"""SWAChunkCache: chunked prefill without prefix reuse on a full + window pool."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from kvcore.cache import EvictResult, InsertResult, LockResult, MatchResult
from kvcore.capabilities import Capability
from kvcore.chunk_cache import ChunkCache
from kvcore.keys import KeyLike, checked_key
from kvcore.tree import check_evict_count
from kvcore_swa.config import require_swa_allocator
from kvcore_swa.window import SlidingWindowMixin, window_size

if TYPE_CHECKING:
    from kvcore.config import CacheInitParams
    from kvcore.pools import SWATokenToKVPoolAllocator

__all__ = ["SWAChunkCache"]


class SWAChunkCache(SlidingWindowMixin, ChunkCache):
    """SGLang's SWAChunkCache: a request's KV lives and dies with it.

    While the request runs, ``free_window_slots`` frees the window slots that
    left its window (exactly the window is kept: there is no tree); on
    finish ``[cache_protected_len, committed)`` goes back, full side only below
    the request's ``swa_evicted_seqlen``.
    """

    # Nothing is locked: the early release is a no-op, answered so a scheduler need not tell the two apart.
    capabilities = frozenset({Capability.WINDOWED, Capability.WINDOW_LOCK_RELEASE})

    token_to_kv_pool_allocator: SWATokenToKVPoolAllocator

    def __init__(self, params: CacheInitParams, sliding_window_size: int | None = None):
        alloc = require_swa_allocator(params.token_to_kv_pool_allocator, "SWAChunkCache")
        super().__init__(params)
        self.token_to_kv_pool_allocator = alloc
        self.sliding_window_size = window_size(params.config, sliding_window_size)

    def match_prefix(self, key: KeyLike) -> MatchResult:
        checked_key(key)
        return MatchResult(device_indices=self._empty, last_device_node=None, best_match_node=None)

    def insert(
        self, key: KeyLike, value: torch.Tensor | None = None, prev_prefix_len: int = 0, swa_evicted_seqlen: int = 0
    ) -> InsertResult:
        """Keeps nothing; the caller keeps (and frees) ``value``."""
        key = checked_key(key)
        if value is not None and len(value) != len(key):
            raise ValueError(f"value has {len(value)} slots but the key has {len(key)} tokens")
        return InsertResult(prefix_len=0)

    def evict(self, num_tokens: int, swa_num_tokens: int = 0) -> EvictResult:
        num_tokens = check_evict_count(num_tokens)
        swa_num_tokens = check_evict_count(swa_num_tokens, "swa_num_tokens")
        return EvictResult(0, 0)

    # Nothing is ever cached: every size is zero.
    def full_evictable_size(self) -> int:
        return 0

    def swa_evictable_size(self) -> int:
        return 0

    def full_protected_size(self) -> int:
        return 0

    def swa_protected_size(self) -> int:
        return 0

    def dec_swa_lock_only(self, node: Any, lock: Any = None) -> LockResult:
        return LockResult(0)

"""The built-in ``chunk`` backend: chunked prefill without prefix reuse."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from kvcore.cache import BasePrefixCache, EvictResult, InsertResult, LockResult, MatchResult
from kvcore.keys import as_radix_key
from kvcore.tree.checks import check_evict_count

if TYPE_CHECKING:
    from kvcore.config import CacheInitParams
    from kvcore.keys import KeyLike
    from kvcore.record import Req

__all__ = ["ChunkCache"]


class ChunkCache(BasePrefixCache):
    """No prefix tree: a request's KV lives and dies with the request.

    ``match_prefix`` always matches nothing and ``insert`` stores nothing; the
    class is public so that authors can build on it (SWA's chunk cache does).
    """

    def __init__(self, params: CacheInitParams):
        if params.token_to_kv_pool_allocator is None:
            # SGLang falls back to a CPU device here; a kvcore cache frees what it is handed, so it needs its pool.
            raise TypeError(
                f"{type(self).__name__} needs a token_to_kv_pool_allocator (got None); "
                "kvcore.create_cache builds the pools from the options"
            )
        super().__init__(params)
        self.device = self.token_to_kv_pool_allocator.device
        self._empty = torch.empty((0,), dtype=torch.int64, device=self.device)

    def is_chunk_cache(self) -> bool:
        return True

    # Nothing is ever cached (SGLang's ChunkCache answers disable=True too).
    disable = True

    def match_prefix(self, key: KeyLike) -> MatchResult:
        as_radix_key(key)
        return MatchResult(device_indices=self._empty, last_device_node=None, best_match_node=None)

    def insert(self, key: KeyLike, value: torch.Tensor | None = None) -> InsertResult:
        key = as_radix_key(key)
        if value is not None and len(value) != len(key):
            raise ValueError(f"value has {len(value)} slots but the key has {len(key)} tokens")
        return InsertResult(prefix_len=0)

    def cache_finished_req(self, req: Req, is_insert: bool = True) -> None:
        self.check_req(req, "cache_finished_req")
        # The protected prefix is not this request's to free.
        self.free_kv_row(req.kv, [(req.kv.cache_protected_len, req.kv.kv_committed_len)])

    def cache_unfinished_req(self, req: Req, chunked: bool = False) -> None:
        self.check_req(req, "cache_unfinished_req")
        row = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx, : req.kv.kv_committed_len]
        req.prefix_indices = row.to(dtype=torch.int64, copy=True)

    def evict(self, num_tokens: int) -> EvictResult:
        check_evict_count(num_tokens)
        return EvictResult()

    def inc_lock_ref(self, node: Any) -> LockResult:
        return LockResult(delta=0)

    def dec_lock_ref(self, node: Any, lock: LockResult | None = None) -> LockResult:
        return LockResult(delta=0)

    def format_tree(self) -> str:
        return ""

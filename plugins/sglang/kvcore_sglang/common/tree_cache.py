"""What SGLang's ``BasePrefixCache`` is answered with by a kvcore backend, whatever the SGLang version.

Version-neutral: SGLang 0.5.19 and 0.5.23 share these calls and results (``RadixKey`` with
``raw_token_ids()`` / ``is_bigram`` / ``extra_key`` / ``cache_salt``, ``EvictParams`` /
``EvictResult``, ``IncLockRefResult(delta=)`` / ``DecLockRefResult(delta=)``, the plain sizes).
A version's tree cache is ``class KvcoreTreeCache(KvcoreCacheCore, BasePrefixCache)``.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from sglang.srt.mem_cache.base_prefix_cache import (  # type: ignore[import-not-found,unused-ignore]
    DecLockRefParams,
    DecLockRefResult,
    EvictParams,
    EvictResult,
    IncLockRefResult,
)

import kvcore
from kvcore_sglang.common.build import UnsupportedContext
from kvcore_sglang.common.fill_ids import RequestTables, namespace
from kvcore_sglang.config import Target

__all__ = ["KvcoreCacheCore"]


class KvcoreCacheCore:
    """The calls every version's kvcore tree cache answers alike, over its kvcore backend (``kvcore_cache``)."""

    # SGLang's BasePrefixCache's, next in the tree cache's bases.
    update_eviction_metrics: Any
    init_metrics_collector: Any

    def __init__(self, target: Target, kvcore_cache: Any, params: Any):
        """``params``: SGLang's ``CacheInitParams``; its pools are the ones the kvcore backend runs on views of."""
        self.target = target
        self.kvcore_cache = kvcore_cache
        self.req_to_token_pool = params.req_to_token_pool
        self.token_to_kv_pool_allocator = params.token_to_kv_pool_allocator
        self.page_size = int(params.page_size)
        # SGLang's trees keep the device their values live on (the CPU for a tree without pools).
        self.device = torch.device(getattr(kvcore_cache, "device", None) or "cpu")
        # What the cache keeps per SGLang Req that the Req has no field for.
        self._tables = RequestTables()
        if params.enable_metrics:
            self.init_metrics_collector()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.target.name} on kvcore {type(self.kvcore_cache).__name__}>"

    @property
    def disable(self) -> bool:
        return bool(self.kvcore_cache.disable)

    @property
    def root_node(self) -> Any:
        return self.kvcore_cache.root_node

    def _key(self, key: Any) -> kvcore.RadixKey:
        """kvcore's key for SGLang's ``RadixKey`` (its ``limit`` applied; ``extra_key`` and ``cache_salt`` joined)."""
        if key.is_bigram:
            raise UnsupportedContext(f"{self.target.name}: EAGLE bigram keys are not supported by kvcore")
        return kvcore.RadixKey(key.raw_token_ids(), namespace(key.extra_key, key.cache_salt))

    def _flush_events(self) -> None:
        """Hand the backend's new page events on (a version that translates them when taken does nothing)."""

    # -- eviction and locks
    def evict(self, params: EvictParams) -> EvictResult:
        start = time.perf_counter()
        done = self.kvcore_cache.evict(params.num_tokens)
        self.update_eviction_metrics(done.num_tokens_evicted, start)
        self._flush_events()
        return EvictResult(num_tokens_evicted=done.num_tokens_evicted)

    def inc_lock_ref(self, node: Any) -> IncLockRefResult:
        # SGLang's delta is the change in evictable tokens; kvcore's the change in protected ones.
        return IncLockRefResult(delta=-self.kvcore_cache.inc_lock_ref(node).delta)

    def dec_lock_ref(self, node: Any, params: DecLockRefParams | None = None) -> DecLockRefResult:
        return DecLockRefResult(delta=-self.kvcore_cache.dec_lock_ref(node).delta)

    # -- sizes
    def evictable_size(self) -> int:
        return int(self.kvcore_cache.evictable_size())

    def protected_size(self) -> int:
        return int(self.kvcore_cache.protected_size())

    def total_size(self) -> Any:
        return int(self.kvcore_cache.total_size())

    def sanity_check(self) -> None:
        """The kvcore tree's own structural check; SGLang's idle check calls it on hybrid trees
        (``SGLANG_ENABLE_TREE_CACHE_SANITY_CHECK``), where a failure is a leak report."""
        if not self.disable:
            self.kvcore_cache.sanity_check()

    def pretty_print(self) -> Any:
        return self.kvcore_cache.pretty_print()

"""``radix`` without pools, as SGLang builds its RadixCache in its own unit tests (values are the caller's)."""

import torch

from kvcore import CacheInitParams
from kvcore_radix import RadixCache, RadixConfig


def tree_only(**options) -> RadixCache:
    return RadixCache(CacheInitParams(req_to_token_pool=None, token_to_kv_pool_allocator=None, page_size=1,
                                      config=RadixConfig(**options)))


def test_builds_and_caches_without_an_allocator():
    cache = tree_only()
    assert cache.tree_only and not cache.strict  # no pool: the strict slot checks have nothing to check against
    assert cache.pools() == []
    assert cache.insert([1, 2, 3], torch.tensor([10, 11, 12])).prefix_len == 0
    assert cache.insert([1, 2, 3, 4]).prefix_len == 3  # value=None: the token ids stand for the slots
    assert cache.match_prefix([1, 2, 3, 4, 5]).device_indices.tolist() == [10, 11, 12, 4]
    assert cache.evictable_size() == cache.total_size() == 4


def test_evict_and_reset_drop_the_callers_values():
    cache = tree_only(eviction_policy="lfu")
    value = torch.tensor([7, 8])
    cache.insert([5, 6], value)
    assert cache.evict(1).num_tokens_evicted == 2
    assert value.tolist() == [7, 8] and cache.total_size() == 0
    cache.insert([9], torch.tensor([3]))
    cache.reset()
    assert cache.total_size() == cache.evictable_size() == 0

"""What the example adds to the kit: its own option (strict, like kvcore's) and what it does."""

import pytest
import torch

import kvcore


def test_its_option_is_strict():
    for bad in (True, "64"):
        with pytest.raises(kvcore.ConfigError, match="option 'min_prefix_tokens': Input should be a valid integer"):
            kvcore.create_cache("example", min_prefix_tokens=bad)


def test_short_prefixes_are_not_reused():
    cache = kvcore.create_cache("example", size=64, max_num_reqs=2, max_context_len=32, min_prefix_tokens=4)
    slots = cache.token_to_kv_pool_allocator.alloc(6)
    assert cache.insert([1, 2, 3, 4, 5, 6], slots).prefix_len == 0
    assert cache.match_prefix([1, 2, 3, 9]).prefix_len == 0  # 3 cached tokens < 4
    assert torch.equal(cache.match_prefix([1, 2, 3, 4, 9]).device_indices, slots[:4])
    kvcore.InvariantChecker(cache).check([])

"""What the stamp component adds to the kit: its options, where a match may end, its limit, hits and locks."""

import pytest
from kvcore_example_component import ExampleComponentConfig, StampOptions

import kvcore
from kvcore import InvariantChecker, RadixKey


def _build(**options):
    opts = {"size": 256, "max_num_reqs": 4, "max_context_len": 64, **options}
    return kvcore.create_cache("example-component", **opts)


def _insert(cache, ids):
    return cache.insert(RadixKey(ids), cache.token_to_kv_pool_allocator.alloc(len(ids)))


def test_its_options():
    assert ExampleComponentConfig.model_fields["stamp_limit"].default == StampOptions.model_validate({}).stamp_limit
    with pytest.raises(kvcore.ConfigError, match="stamp_limit.*component 'stamp'"):
        _build(stamp_limit=0)
    with pytest.raises(kvcore.ConfigError, match="component set"):
        _build(components=("full",))
    with pytest.raises(kvcore.ConfigError, match="host_size and store need components=\\('full',\\)"):
        _build(host_size=512, kv_buffer={})


def test_a_match_ends_only_where_an_insert_ended():
    cache = _build()
    _insert(cache, list(range(10)))
    assert cache.cached_sizes() == {"full": (10, 0), "stamp": (1, 0)}
    assert cache.match_prefix(list(range(6)) + [99]).prefix_len == 0  # splits the node; the upper half has no stamp
    _insert(cache, list(range(6)))  # a request boundary there now
    assert cache.match_prefix(list(range(6)) + [99]).prefix_len == 6
    assert cache.match_prefix(list(range(8))).prefix_len == 6
    m = cache.match_prefix(list(range(10)))
    assert m.prefix_len == 10
    assert m.last_device_node.stamp_hits == 1 and cache.stats() == {"stamp_hits": 3}
    InvariantChecker(cache).check([])


def test_at_the_limit_a_new_stamp_evicts_the_least_recently_used():
    cache = _build(stamp_limit=2)
    _insert(cache, [1, 1, 1, 1])
    _insert(cache, [1, 1, 2, 2])  # splits [1, 1]: an unstamped internal node above two stamped leaves
    cache.match_prefix([1, 1, 1, 1])  # [1, 1, 1, 1] is now the most recently used stamp
    _insert(cache, [3, 3])  # at the limit: the stamp of [1, 1, 2, 2] goes, a leaf, with its full slots
    assert cache.match_prefix([1, 1, 2, 2]).prefix_len == 0
    assert cache.cached_sizes() == {"full": (6, 0), "stamp": (2, 0)}
    _insert(cache, [1, 1])  # evicts [1, 1, 1, 1]'s stamp and that leaf, then stamps [1, 1]
    assert cache.cached_sizes() == {"full": (4, 0), "stamp": (2, 0)}
    # A locked stamp stays: with every stamp locked a new boundary is not stamped, and nothing is evicted.
    locks = [(m.last_device_node, cache.inc_lock_ref(m.last_device_node))
             for m in (cache.match_prefix([1, 1]), cache.match_prefix([3, 3]))]
    _insert(cache, [4, 4, 4])
    assert cache.match_prefix([4, 4, 4]).prefix_len == 0
    assert cache.cached_sizes() == {"full": (3, 4), "stamp": (0, 2)}
    for node, lock in locks:
        cache.dec_lock_ref(node, lock)
    cache.sanity_check()
    InvariantChecker(cache).check([])


def test_its_own_eviction_keeps_internal_full_slots():
    cache = _build()
    _insert(cache, [5, 5])
    _insert(cache, [5, 5, 6, 6])
    res = cache.evict(0, stamp=1)  # the older stamp is on the internal node: only the stamp goes
    assert res.by_component == {"full": 0, "stamp": 1}
    assert cache.cached_sizes() == {"full": (4, 0), "stamp": (1, 0)}
    assert cache.match_prefix([5, 5, 9]).prefix_len == 0
    assert cache.evict(0, stamp=1).by_component == {"full": 2, "stamp": 1}  # a leaf goes whole
    assert cache.cached_sizes() == {"full": (2, 0), "stamp": (0, 0)}
    InvariantChecker(cache).check([])
    assert cache.evict(10**6).num_tokens_evicted == 2  # a leaf left with its full slots only is still evictable
    assert cache.token_to_kv_pool_allocator.available_size() == 256
    InvariantChecker(cache).check([])


@pytest.mark.parametrize("page_size", [1, 16])
def test_fuzz_at_a_small_limit(page_size):
    # The kit's fuzz run never reaches the default limit; here nearly every insert evicts a stamp.
    from kvcore.fuzz import run_fuzz

    run_fuzz("example-component", 3000, seed=1, check_every=25, page_size=page_size,
             backend_options={"stamp_limit": 3})

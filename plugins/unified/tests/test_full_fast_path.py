"""Full-only unified: insert reuses the last match walk; answers and checks as without it."""

import pytest

import kvcore
from kvcore import InvariantChecker, RadixKey


def _cache(ps=1):
    return kvcore.create_cache("unified", size=256, page_size=ps)


def _state(c):
    return (c.total_size(), c.evictable_size(), c.token_to_kv_pool_allocator.available_size(),
            sorted((tuple(x.key), x.value.tolist()) for x in c._nodes()))


@pytest.mark.parametrize("ps", [1, 4])
def test_insert_after_match_same_as_without(ps):
    a, b = _cache(ps), _cache(ps)
    keys = [list(range(2, 2 + 4 * ps)), list(range(2, 2 + 2 * ps)) + [99] * (2 * ps),
            list(range(2, 2 + 3 * ps)) + [7] * ps, list(range(2, 2 + 4 * ps))]
    for k in keys:
        for c, do_match in ((a, True), (b, False)):
            v = c.token_to_kv_pool_allocator.alloc(len(k))
            if do_match:
                c.match_prefix(RadixKey(list(k)))
            r = c.insert(RadixKey(list(k)), v)
            assert r.prefix_len >= 0
    assert _state(a) == _state(b)
    for c in (a, b):
        c.sanity_check()
        InvariantChecker(c).check([])


def test_reuse_still_refuses_bad_tail():
    c = _cache()
    v = c.token_to_kv_pool_allocator.alloc(4)
    c.insert(RadixKey([5, 6, 7, 8]), v)
    bad = [5, 6, True, 9]
    c.match_prefix(RadixKey([5, 6, 1, 9]))  # splits [5 6 | 7 8]
    before = _state(c)
    w = c.token_to_kv_pool_allocator.alloc(4)
    with pytest.raises(TypeError, match="bool"):
        c.insert(RadixKey(bad), w)
    c.token_to_kv_pool_allocator.free(w)
    assert _state(c) == before
    c.sanity_check()
    InvariantChecker(c).check([])


def test_reuse_checks_unaligned_tail():
    c = _cache(4)
    c.match_prefix(RadixKey([5, 6, 7, 8, 9, 10, 11, 12]))
    w = c.token_to_kv_pool_allocator.alloc(12)
    with pytest.raises(TypeError):
        c.insert(RadixKey([5, 6, 7, 8, 9, 10, 11, 12, 1.5]), w[:9])
    assert c.total_size() == 0
    c.token_to_kv_pool_allocator.free(w)
    InvariantChecker(c).check([])


def test_shape_change_between_match_and_insert():
    c = _cache()
    alloc = c.token_to_kv_pool_allocator.alloc
    c.insert(RadixKey([2, 3, 4, 5]), alloc(4))
    c.match_prefix(RadixKey([2, 3, 4, 5, 6, 7]))
    c.insert(RadixKey([2, 3, 9]), alloc(3))  # splits the matched node
    c.evict(100)
    r = c.insert(RadixKey([2, 3, 4, 5, 6, 7]), alloc(6))
    assert r.prefix_len == 0 and c.total_size() == 6
    c.sanity_check()
    InvariantChecker(c).check([])

"""release_kv_cache, free_swa_out_of_window_slots and the row-range free, on real pools."""

import pytest

from kvcore import (
    CacheConfig,
    CacheInitParams,
    ChunkCache,
    InvariantChecker,
    Req,
    ReqToTokenPool,
    SWATokenToKVPoolAllocator,
    create_cache,
    free_swa_out_of_window_slots,
    release_kv_cache,
)
from kvcore.factory import attach_lifecycle
from kvcore.testing import extend_slots


def admit(cache, req, n):
    """Give req a row and n freshly allocated positions (no prefix reuse)."""
    assert cache.req_to_token_pool.alloc([req]) is not None
    assert extend_slots(cache, req, n)


def swa_chunk_cache(size=256, size_swa=128, page_size=1):
    config = CacheConfig(size=size, page_size=page_size, max_num_reqs=8, max_context_len=256)
    params = CacheInitParams(
        req_to_token_pool=ReqToTokenPool(8, 256),
        token_to_kv_pool_allocator=SWATokenToKVPoolAllocator(size, size_swa, page_size=page_size),
        page_size=page_size,
        config=config,
    )
    cache = ChunkCache(params)
    attach_lifecycle(cache)
    return cache


@pytest.mark.parametrize("page_size", [1, 4])
def test_release_frees_everything_and_marks_released(page_size):
    cache = create_cache("chunk", size=64, page_size=page_size, max_num_reqs=4, max_context_len=64)
    req = Req("a", list(range(10)))
    admit(cache, req, 16)
    req.kv.kv_committed_len = 10  # over-allocated by 6 (a speculative tail, say)
    InvariantChecker(cache).check([req])
    release_kv_cache(req, cache)
    assert not req.kv.is_held and req.kv.is_released
    assert cache.token_to_kv_pool_allocator.available_size() == 64
    assert cache.req_to_token_pool.available_size() == 4
    InvariantChecker(cache).check([req])


def test_release_of_a_request_holding_nothing_is_a_no_op():
    cache = create_cache("chunk", size=16, max_num_reqs=2, max_context_len=16)
    req = Req("idle", [1, 2])
    release_kv_cache(req, cache)
    assert cache.token_to_kv_pool_allocator.available_size() == 16
    InvariantChecker(cache).check([req])


def test_release_rejects_committed_past_allocated_and_changes_nothing():
    cache = create_cache("chunk", size=16, max_num_reqs=2, max_context_len=16)
    req = Req("bad", [1, 2, 3])
    admit(cache, req, 3)
    req.kv.kv_committed_len = 5
    with pytest.raises(ValueError, match="cache_protected_len <= kv_committed_len <= kv_allocated_len, got 0, 5, 3"):
        release_kv_cache(req, cache)
    assert req.kv.is_held and cache.token_to_kv_pool_allocator.available_size() == 13
    req.kv.kv_committed_len = 3
    release_kv_cache(req, cache)
    InvariantChecker(cache).check([req])


def test_release_asserts_held_iff_not_released():
    cache = create_cache("chunk", size=16, max_num_reqs=2, max_context_len=16)
    req = Req("odd", [1])
    req.kv.kv_allocated_len = 4  # not held, but claims allocation
    with pytest.raises(AssertionError, match="is_held=False but is_released=False"):
        release_kv_cache(req, cache)


def test_hook_cache_finished_req():
    """Lifecycle wrappers see each finish once, around the backend's answer."""
    from kvcore import hookimpl

    cache = create_cache("chunk", size=16, max_num_reqs=2, max_context_len=16)
    seen = []

    class Metrics:
        @hookimpl(wrapper=True)
        def cache_finished_req(self, req, is_insert):
            seen.append(("before", req.rid, cache.token_to_kv_pool_allocator.available_size()))
            result = yield
            seen.append(("after", req.rid, cache.token_to_kv_pool_allocator.available_size()))
            return result

    cache.plugin_manager.register(Metrics())
    req = Req("w", [1, 2, 3])
    admit(cache, req, 3)
    req.kv.kv_committed_len = 3
    release_kv_cache(req, cache)
    assert seen == [("before", "w", 13), ("after", "w", 16)]
    InvariantChecker(cache).check([req])


# -- sliding window --------------------------------------------------------------


@pytest.mark.parametrize(
    "is_chunk, page, window, pre_len, retain, expected",
    [
        (True, 1, 8, 20, None, 12),  # chunk: exactly the window
        (False, 1, 8, 20, None, 12),  # tree: max(window, page) == window
        (False, 4, 2, 20, None, 16),  # tree: keep a whole page, floored to a page
        (True, 4, 6, 20, None, 12),  # chunk: 14 floored to a page
        (False, 1, 8, 20, 5, 5),  # retain floor caps the cursor
        (True, 1, 8, 20, 5, 12),  # chunk caches ignore the retain floor
        (False, 1, 8, 6, None, 0),  # nothing out of the window yet
    ],
)
def test_free_swa_out_of_window_thresholds(is_chunk, page, window, pre_len, retain, expected):
    cache = swa_chunk_cache(page_size=page)
    req = Req("d", list(range(pre_len)))
    admit(cache, req, pre_len if page == 1 else -(-pre_len // page) * page)
    req.kv.kv_committed_len = req.kv.kv_allocated_len = pre_len
    swa_before = cache.token_to_kv_pool_allocator.swa_available_size()
    free_swa_out_of_window_slots(
        req, pre_len, sliding_window_size=window, page_size=page,
        req_to_token_pool=cache.req_to_token_pool, token_to_kv_pool_allocator=cache.token_to_kv_pool_allocator,
        is_chunk_cache=is_chunk, retain_floor=retain,
    )
    assert req.kv.swa_evicted_seqlen == expected
    assert cache.token_to_kv_pool_allocator.swa_available_size() - swa_before == expected
    InvariantChecker(cache).check([req])
    release_kv_cache(req, cache)
    InvariantChecker(cache).check([req])
    assert cache.token_to_kv_pool_allocator.full_available_size() == 256
    assert cache.token_to_kv_pool_allocator.swa_available_size() == 128


def test_free_swa_never_below_dead_lo():
    cache = swa_chunk_cache(page_size=4)
    req = Req("floor", list(range(40)))
    admit(cache, req, 40)
    req.kv.kv_committed_len = 40
    req.kv.swa_evict_floor = 30  # rounds up to 32
    kw = dict(sliding_window_size=4, page_size=4, req_to_token_pool=cache.req_to_token_pool,
              token_to_kv_pool_allocator=cache.token_to_kv_pool_allocator)
    free_swa_out_of_window_slots(req, 20, **kw)
    assert req.kv.swa_evicted_seqlen == 32  # the cursor jumps to dead_lo, nothing below is freed by it
    free_swa_out_of_window_slots(req, 40, **kw)
    assert req.kv.swa_evicted_seqlen == 36


def test_free_swa_rejects_unaligned_protected_prefix():
    cache = swa_chunk_cache(page_size=4)
    req = Req("x", list(range(8)))
    admit(cache, req, 8)
    req.kv.kv_committed_len = 8
    req.kv.cache_protected_len = 3
    with pytest.raises(ValueError, match="not aligned"):
        free_swa_out_of_window_slots(req, 8, sliding_window_size=2, page_size=4,
                                     req_to_token_pool=cache.req_to_token_pool,
                                     token_to_kv_pool_allocator=cache.token_to_kv_pool_allocator)
    assert req.kv.swa_evicted_seqlen == 0


def test_row_free_splits_at_the_window_cursor():
    cache = swa_chunk_cache()
    alloc = cache.token_to_kv_pool_allocator
    req = Req("split", list(range(10)))
    admit(cache, req, 10)
    req.kv.kv_committed_len = 10
    free_swa_out_of_window_slots(req, 10, sliding_window_size=4, page_size=1,
                                 req_to_token_pool=cache.req_to_token_pool, token_to_kv_pool_allocator=alloc,
                                 is_chunk_cache=True)
    assert req.kv.swa_evicted_seqlen == 6
    full, swa = alloc.full_available_size(), alloc.swa_available_size()
    cache.free_kv_row(req.kv, [(3, 5), (7, 10)])  # 3, 4: full only; 7, 8, 9: both sides
    assert alloc.full_available_size() - full == 5
    assert alloc.swa_available_size() - swa == 3
    cache.free_kv_row(req.kv, [(5, 7)])
    req.kv.kv_allocated_len = req.kv.kv_committed_len = 3
    release_kv_cache(req, cache)
    InvariantChecker(cache).check([req])
    assert alloc.full_available_size() == 256 and alloc.swa_available_size() == 128


@pytest.mark.parametrize("page_size", [1, 4])
def test_window_floor_keeps_its_slots_and_release_returns_them(page_size):
    cache = swa_chunk_cache(page_size=page_size)
    alloc = cache.token_to_kv_pool_allocator
    req = Req("floored", list(range(48)))
    admit(cache, req, 48)
    req.kv.kv_committed_len = 48
    req.kv.swa_evict_floor = 10  # e.g. an image prefix the window must not evict
    free_swa_out_of_window_slots(req, 48, sliding_window_size=8, page_size=page_size,
                                 req_to_token_pool=cache.req_to_token_pool, token_to_kv_pool_allocator=alloc,
                                 is_chunk_cache=True)
    dead_lo = req.kv.swa_dead_lo(page_size)
    assert dead_lo == (10 if page_size == 1 else 12) and req.kv.swa_evicted_seqlen == 40
    assert alloc.swa_available_size() == 128 - 48 + (40 - dead_lo)
    (_, swa) = InvariantChecker(cache).check([req])
    assert swa.uncached == dead_lo + (48 - 40)
    release_kv_cache(req, cache)
    InvariantChecker(cache).check([req])
    assert alloc.full_available_size() == 256 and alloc.swa_available_size() == 128

"""Unit tests of the pure-SWA backends (``swa-pure``, ``swa-pure-chunk``): every layer sliding-window.

The floor (``swa_evict_floor``, prefill-aware SWA) is where these backends differ
from every other: it keeps a prompt's KV through a decode of any length, and the
tree caches exactly that prefix when the request finishes.
"""

from __future__ import annotations

import pytest
import torch

import kvcore
from kvcore import Engine, InvariantChecker, RadixKey, Req, create_cache
from kvcore.record import ceil_align
from kvcore.testing.swa import window_slots_held
from kvcore_swa import PureSWAChunkCache, PureSWARadixCache, PureSWATokenToKVPoolAllocator

PURE = ["swa-pure", "swa-pure-chunk"]


def make(name: str, page_size: int = 1, window: int = 8, size: int = 512, **kw):
    return create_cache(name, size=size, page_size=page_size, sliding_window_size=window, max_num_reqs=8,
                        max_context_len=512, **kw)


def toks(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def check(cache, owners=()) -> None:
    InvariantChecker(cache).check(owners)


def is_free(cache, slots: torch.Tensor) -> torch.Tensor:
    free = cache.token_to_kv_pool_allocator.free_slots()
    return torch.isin(slots.to(torch.int64), free)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("cache_prompt", [False, True])
@pytest.mark.parametrize("name", PURE)
def test_floor_keeps_the_prompt_through_a_long_decode(name, page_size, cache_prompt):
    """The prompt's KV survives 20 windows of decode; the window stays bounded; the tree keeps the prompt."""
    cache = make(name, page_size)
    eng = Engine(cache, cache_prompt=cache_prompt)
    prompt = toks(21, 100)
    req = Req("r", prompt)
    req.kv.swa_evict_floor = len(prompt)  # what SGLang's scheduler sets for prefill-aware SWA
    assert eng.admit(req)
    assert eng.extend(req, chunked=False)
    row = cache.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
    floor_slots = row[: len(prompt)].to(torch.int64).clone()
    W = cache.sliding_window_size
    dead_lo = req.kv.swa_dead_lo(page_size)
    assert dead_lo == ceil_align(len(prompt), page_size)
    for step in range(20 * W):
        assert eng.decode([req], [step % 7]) == 1
        assert not is_free(cache, floor_slots).any(), f"step {step}: a floor-protected slot went back"
        held = window_slots_held(req.kv, page_size)
        # The floor's part plus at most the window, a page and the token just decoded.
        assert held <= (dead_lo - req.kv.cache_protected_len) + W + 2 * page_size, (step, held, req.kv)
        if step % W == 0:
            report = {r.pool: r for r in InvariantChecker(cache).check([req])}["full"]
            assert report.uncached == held + (ceil_align(req.kv.kv_allocated_len, page_size)
                                              - req.kv.kv_allocated_len)
    assert req.kv.swa_evicted_seqlen > dead_lo
    assert torch.equal(row[: len(prompt)].to(torch.int64), floor_slots)
    eng.finish(req)
    check(cache)
    alloc = cache.token_to_kv_pool_allocator
    if name == "swa-pure":
        cached = ceil_align(len(prompt), page_size)
        assert cache.evictable_size() == cached == cache.swa_evictable_size()
        assert cache.full_evictable_size() == 0
        # The cached key is the prompt and, to the page, the first decoded tokens.
        m = cache.match_prefix(RadixKey(req.fill_ids))
        assert m.prefix_len == cached
        assert torch.equal(m.device_indices[: len(prompt)], floor_slots)
        assert alloc.available_size() + cached == alloc.size
        # A second request reuses the prompt after the first one's long decode.
        r2 = Req("r2", prompt + toks(3, 900))
        assert eng.admit(r2)
        assert r2.kv.cache_protected_len >= len(prompt) // page_size * page_size
        eng.abort(r2)
        check(cache)
        cache.evict(10**6)
    assert alloc.available_size() == alloc.size
    check(cache)


@pytest.mark.parametrize("page_size", [1, 4])
def test_no_floor_long_decode_caches_only_what_prefill_inserted(page_size):
    """Without a floor the window frees the prompt too; the finish then inserts nothing it freed."""
    cache = make("swa-pure", page_size)
    eng = Engine(cache, cache_prompt=False)
    req = Req("r", toks(19, 1))
    assert eng.admit(req) and eng.extend(req, chunked=False)
    for step in range(6 * cache.sliding_window_size):
        eng.decode([req], [step])
        check(cache, [req])
    assert req.kv.swa_evicted_seqlen > 0
    eng.finish(req)
    check(cache)
    assert cache.evictable_size() == 0
    alloc = cache.token_to_kv_pool_allocator
    assert alloc.available_size() == alloc.size


@pytest.mark.parametrize("page_size", [1, 4])
def test_short_decode_caches_everything(page_size):
    """Inside the window a pure-SWA tree behaves as radix: the whole committed key is cached."""
    cache = make("swa-pure", page_size, window=64)
    eng = Engine(cache, cache_prompt=False)
    req = Req("r", toks(10, 1))
    assert eng.admit(req) and eng.extend(req, chunked=False)
    for step in range(7):
        eng.decode([req], [step])
    assert req.kv.swa_evicted_seqlen == 0
    eng.finish(req)
    check(cache)
    assert cache.evictable_size() == 17 // page_size * page_size


def test_floor_rounds_up_to_a_page_and_caps_the_insert():
    cache = make("swa-pure", page_size=4, window=64)
    eng = Engine(cache, cache_prompt=False)
    req = Req("r", toks(12, 1))
    req.kv.swa_evict_floor = 5
    assert eng.admit(req) and eng.extend(req, chunked=False)
    assert cache.insert_end(req) == 8
    eng.finish(req)
    check(cache)
    assert cache.evictable_size() == 8
    alloc = cache.token_to_kv_pool_allocator
    assert alloc.available_size() == alloc.size - 8


@pytest.mark.parametrize("name", PURE)
def test_abort_under_a_floor_before_any_window_free_returns_everything(name):
    """SGLang's is_insert=False path leaks [floor, committed) when no window free ran yet; kvcore does not."""
    cache = make(name)
    eng = Engine(cache, cache_prompt=False)
    req = Req("r", toks(30, 1))
    req.kv.swa_evict_floor = 10
    assert eng.admit(req) and eng.extend(req, chunked=False)
    assert req.kv.swa_evicted_seqlen == 0
    eng.abort(req)
    check(cache)
    alloc = cache.token_to_kv_pool_allocator
    assert alloc.available_size() == alloc.size and cache.evictable_size() == 0


def test_evict_takes_the_larger_count_and_sizes_use_sglang_names():
    cache = make("swa-pure", window=64)
    eng = Engine(cache, cache_prompt=False)
    for i in range(3):
        r = Req(f"r{i}", toks(6, 10 * i + 1))
        assert eng.admit(r) and eng.extend(r, chunked=False)
        eng.finish(r)
    assert cache.swa_evictable_size() == cache.evictable_size() == 18
    assert (cache.full_evictable_size(), cache.full_protected_size(), cache.swa_protected_size()) == (0, 0, 0)
    res = cache.evict(0, 7)
    assert res.num_tokens_evicted == res.swa_num_tokens_evicted == 12
    res = cache.evict(5, 0)
    assert res.num_tokens_evicted == 6
    check(cache)
    with pytest.raises(ValueError):
        cache.evict(0, -1)


def test_pure_allocator_names():
    alloc = PureSWATokenToKVPoolAllocator(16, 1)
    slots = alloc.alloc(4)
    assert torch.equal(alloc.translate_loc_from_full_to_swa(slots), slots)
    alloc.free_full(slots)  # no full side: nothing goes back
    assert alloc.full_available_size() == alloc.swa_available_size() == 12
    alloc.free_swa(slots[:2])
    assert alloc.available_size() == 14
    with pytest.raises(ValueError):
        alloc.free_full(torch.tensor([99]))
    (view,) = alloc.pool_views()
    assert (view.name, view.windowed, view.translate) == ("full", True, None)


def test_backends_refuse_a_two_pool_allocator_and_window_pool_options():
    from kvcore.config import CacheInitParams
    from kvcore.pools import ReqToTokenPool, SWATokenToKVPoolAllocator
    from kvcore_swa import PureSWAChunkConfig, PureSWAConfig

    rtp = ReqToTokenPool(2, 64)
    hybrid = SWATokenToKVPoolAllocator(64, 64)
    for cls, cfg in ((PureSWARadixCache, PureSWAConfig), (PureSWAChunkCache, PureSWAChunkConfig)):
        params = CacheInitParams(req_to_token_pool=rtp, token_to_kv_pool_allocator=hybrid, page_size=1,
                                 config=cfg(size=64, sliding_window_size=8))
        with pytest.raises(TypeError, match="PureSWATokenToKVPoolAllocator"):
            cls(params)
    for name in PURE:
        with pytest.raises(Exception, match="swa_size"):
            make(name, swa_size=64)
        with pytest.raises(Exception, match="sliding_window_size"):
            make(name, window=0)


def test_cache_unfinished_after_a_window_free_is_refused_unchanged():
    cache = make("swa-pure")
    eng = Engine(cache, cache_prompt=False)
    req = Req("r", toks(10, 1))
    assert eng.admit(req) and eng.extend(req, chunked=False)
    for step in range(20):
        eng.decode([req], [step])
    before = (req.kv.cache_protected_len, cache.evictable_size(), cache.token_to_kv_pool_allocator.available_size())
    with pytest.raises(ValueError, match="window freed"):
        kvcore.cache_unfinished_req(req, cache)
    assert before == (req.kv.cache_protected_len, cache.evictable_size(),
                      cache.token_to_kv_pool_allocator.available_size())
    eng.finish(req)
    check(cache)


def test_chunked_prefill_then_decode_with_prefill_aware_floor():
    """The scheduler's order: each chunk moves the floor to its end; chunks are cached as they go."""
    cache = make("swa-pure", page_size=4, window=8)
    eng = Engine(cache)
    prompt = toks(26, 3)
    req = Req("r", prompt)
    assert eng.admit(req)
    for end in (8, 16, 26):
        req.kv.swa_evict_floor = end
        assert eng.extend(req, end)
        check(cache, [req])
    for step in range(40):
        eng.decode([req], [step])
        check(cache, [req])
    eng.finish(req)
    check(cache)
    assert cache.evictable_size() == ceil_align(26, 4)
    m = cache.match_prefix(RadixKey(prompt + [1, 2, 3, 4, 5, 6]))
    assert m.prefix_len == 28 or m.prefix_len == 24  # page-aligned key: 32 tokens, 28 cached


def test_a_chunk_cache_without_an_allocator_is_refused():
    """SGLang's ChunkCache falls back to CPU without an allocator; kvcore's refuses (CONTRACT-NOTES)."""
    from kvcore import CacheConfig, ChunkCache
    from kvcore.config import CacheInitParams
    from kvcore.pools import ReqToTokenPool

    params = CacheInitParams(req_to_token_pool=ReqToTokenPool(2, 64), token_to_kv_pool_allocator=None,  # type: ignore[arg-type]
                             page_size=1, config=CacheConfig(size=64))
    with pytest.raises(TypeError, match="token_to_kv_pool_allocator"):
        ChunkCache(params)


def test_swa_pure_builds_on_the_core_tree_without_the_radix_backend(monkeypatch):
    import kvcore.plugins
    from kvcore.tree.unified import UnifiedRadixCache

    real = kvcore.plugins.get_backend

    def no_radix(name):
        if name == "radix":
            raise LookupError(f"no backend {name!r}")
        return real(name)

    monkeypatch.setattr(kvcore.plugins, "get_backend", no_radix)
    cache = make("swa-pure")
    assert type(cache.tree) is UnifiedRadixCache and cache.tree.radix

"""The calls outside a request's path, against SGLang 0.5.19's own classes: ``insert(InsertParams)`` and its answers.

SGLang's trees all take ``insert(InsertParams)`` (its RadixCache unit tests, the buffer-mode
pipeline and the unified linker call it).  Here:

* SGLang's ``RadixCache`` unit tests (``test/registered/radix_cache/test_radix_cache_unit.py`` in
  SGLang's repository: its ``TestRadixCache`` calls, as SGLang 0.5.19's API takes them; the tests
  of SGLang's own internals -- ``TreeNode``, ``RadixKey``, node hashes, multi-tenant caches -- are
  left out), each run on SGLang's ``RadixCache.create_simulated`` and on ``kvcore-radix`` built
  through SGLang's registry with the same ``CacheInitParams``.  Where SGLang's test hands its tree a
  ``unittest.mock.Mock`` allocator, both trees get SGLang's real ``TokenToKVPoolAllocator`` with
  ``free_segment`` spied on, and the values are slots taken from it (kvcore's views call it).
* ``insert`` on every tree kind beside SGLang's counterpart, on SGLang's pools (``World`` of
  ``tools/sglang_request_path_shim.py``): the answers, the pools and the trees equal after
  every call; SGLang's pool checks and kvcore's ``InvariantChecker`` after each.
* ``kvcore-unified`` on a full-attention model answers ``total_size()`` as SGLang's
  ``UnifiedRadixCache`` does, a pair.
* ``kvcore-swa`` and ``kvcore-mamba`` against SGLang's ``UnifiedRadixCache`` with components
  full + swa / full + mamba: each eviction's counts are the pools' gains on both sides;
  ``mamba_value`` and ``mamba_exist``.
* What SGLang's ``UnifiedRadixCache`` answers outside a request's path on every component set
  (sizes, ``total_size()``, the leak dump's flattened values, ``available_and_evictable_str()``,
  the eviction metrics' full tokens), for ``kvcore-unified``, ``kvcore-swa`` and ``kvcore-mamba``.

Stubbed (CPU only): SGLang's Triton allocation kernels and ``write_cache_indices`` (the
``sglang_request_path`` fixture), as in ``test_request_path_differential.py``.
"""

from __future__ import annotations

import unittest.mock
from array import array
from typing import Any

import pytest
import torch
from kvcore_sglang.v0_5_19 import KvcoreTreeCache, KvcoreUnifiedTreeCache
from sglang.srt.disaggregation.kv_events import BlockRemoved, BlockStored
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, EvictResult, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
from sglang.srt.mem_cache.registry import TreeCacheBuildContext, create_tree_cache
from sglang.srt.plugins import load_plugins
from sglang.srt.runtime_context import get_context

import kvcore
from tools.sglang_request_path_shim import MambaWorld, SWAWorld, World

pytestmark = pytest.mark.usefixtures("sglang_request_path")


def key(ids: list[int], extra_key: str | None = None) -> RadixKey:
    return RadixKey(array("q", ids), extra_key)


def ids_of(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


# ---------------------------------------------------------------------------- SGLang's RadixCache unit tests


def simulated(impl: str, *, disable: bool = False, mock_allocator: Any = None, page_size: int = 1,
              enable_kv_cache_events: bool = False) -> Any:
    """SGLang's ``RadixCache.create_simulated`` (``impl="sglang"``), or the same parameters through the registry."""
    if impl == "sglang":
        return RadixCache.create_simulated(disable=disable, mock_allocator=mock_allocator, page_size=page_size,
                                           enable_kv_cache_events=enable_kv_cache_events)
    params = CacheInitParams(disable=disable, req_to_token_pool=None, token_to_kv_pool_allocator=mock_allocator,
                             page_size=page_size, enable_kv_cache_events=enable_kv_cache_events)
    load_plugins()
    with get_context().override_server_args(radix_cache_backend=impl) as server_args:
        cache = create_tree_cache(TreeCacheBuildContext(
            server_args=server_args, params=params, is_hybrid_swa=False, is_hybrid_ssm=False,
            enable_hierarchical_cache=False, disable_radix_cache=False, effective_chunked_prefill_size=None,
            tp_worker=None, model_config=None, tp_size=1, tp_rank=0, tp_group=None,
        ))
    assert isinstance(cache, KvcoreTreeCache)
    return cache


def check(cache: Any) -> None:
    """kvcore's invariant checker, where there are pools to check (SGLang's simulated tree has no request table)."""
    if isinstance(cache, KvcoreTreeCache) and cache.req_to_token_pool is not None:
        kvcore.InvariantChecker(cache.kvcore_cache).check(owners=[])


IMPLS = ["sglang", "kvcore-radix"]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(("page_size", "disable", "enable_events"), [(1, False, False), (4, False, True),
                                                                      (1, True, False)])
def test_init_variations(impl, page_size, disable, enable_events):
    cache = simulated(impl, disable=disable, page_size=page_size, enable_kv_cache_events=enable_events)
    assert cache.page_size == page_size
    assert cache.disable == disable
    assert cache.device == torch.device("cpu")
    assert cache.root_node is not None and len(cache.root_node.key) == 0
    check(cache)


@pytest.mark.parametrize("impl", IMPLS)
def test_reset(impl):
    cache = simulated(impl)
    cache.insert(InsertParams(key=key([1, 2, 3]), value=ids_of([10, 20, 30])))
    assert cache.total_size() > 0
    cache.reset()
    assert cache.total_size() == cache.evictable_size() == cache.protected_size() == 0
    check(cache)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("disable", [False, True])
def test_insert_and_match_basic(impl, disable):
    cache = simulated(impl, disable=disable)
    value = ids_of([10, 20, 30])
    result = cache.insert(InsertParams(key=key([1, 2, 3]), value=value))
    assert result.prefix_len == 0
    if disable:
        assert cache.total_size() == 0
        return
    assert cache.total_size() == cache.evictable_size() == 3
    found = cache.match_prefix(MatchPrefixParams(key=key([1, 2, 3])))
    torch.testing.assert_close(found.device_indices, value)
    found = cache.match_prefix(MatchPrefixParams(key=key([1, 2])))
    torch.testing.assert_close(found.device_indices, ids_of([10, 20]))
    # Cached already: the whole key (the caller frees its copy, as with SGLang's RadixCache).
    again = cache.insert(InsertParams(key=key([1, 2, 3, 4]), value=ids_of([11, 21, 31, 40])))
    assert again.prefix_len == 3 and cache.total_size() == 4
    assert again.last_device_node is cache.match_prefix(MatchPrefixParams(key=key([1, 2, 3, 4]))).last_device_node
    check(cache)


@pytest.mark.parametrize("impl", IMPLS)
def test_insert_with_none_value(impl):
    """SGLang's fallback: no value takes the token ids as values."""
    cache = simulated(impl)
    assert cache.insert(InsertParams(key=key([1, 2, 3]), value=None)).prefix_len == 0
    assert cache.total_size() == 3
    torch.testing.assert_close(cache.match_prefix(MatchPrefixParams(key=key([1, 2, 3]))).device_indices,
                               ids_of([1, 2, 3]))
    check(cache)


@pytest.mark.parametrize("impl", IMPLS)
def test_total_size(impl):
    cache = simulated(impl)
    assert cache.total_size() == 0
    cache.insert(InsertParams(key=key([1, 2, 3]), value=ids_of([10, 20, 30])))
    assert cache.total_size() == 3
    cache.insert(InsertParams(key=key([4, 5]), value=ids_of([40, 50])))
    assert cache.total_size() == 5
    check(cache)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(("page_size", "enable_events"), [(1, True), (2, True), (1, False)])
def test_kv_cache_events(impl, page_size, enable_events):
    cache = simulated(impl, page_size=page_size, enable_kv_cache_events=enable_events)
    cache.insert(InsertParams(key=key([1, 2, 3, 4, 5]), value=None))
    events = cache.take_events()
    if not enable_events:
        assert events == []
        return
    # SGLang 0.5.19 publishes a node's pages as one BlockStored, a hash per whole page.
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert stored and all(e.block_size == page_size for e in stored)
    assert sum(len(e.block_hashes) for e in stored) == 5 // page_size
    check(cache)


def real_allocator(size: int = 32) -> TokenToKVPoolAllocator:
    return TokenToKVPoolAllocator(size, torch.float16, "cpu", None, False)


@pytest.mark.parametrize("impl", IMPLS)
def test_kv_cache_events_with_eviction(impl):
    alloc = real_allocator()
    cache = simulated(impl, mock_allocator=alloc, enable_kv_cache_events=True)
    cache.insert(InsertParams(key=key([1, 2, 3]), value=alloc.alloc(3)))
    result = cache.evict(EvictParams(num_tokens=3))
    assert isinstance(result, EvictResult) and result.num_tokens_evicted >= 3
    events = cache.take_events()
    assert "BlockStored" in [type(e).__name__ for e in events]
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert removed and all(len(e.block_hashes) > 0 for e in removed)
    assert alloc.available_size() == 32
    check(cache)


@pytest.mark.parametrize("impl", IMPLS)
def test_extra_key_isolation(impl):
    cache = simulated(impl)
    for extra, value in (("key1", [10, 20, 30]), ("key2", [40, 50, 60]), (None, [70, 80, 90])):
        cache.insert(InsertParams(key=key([1, 2, 3], extra), value=ids_of(value)))
    for extra, value in (("key1", [10, 20, 30]), ("key2", [40, 50, 60]), (None, [70, 80, 90])):
        torch.testing.assert_close(cache.match_prefix(MatchPrefixParams(key=key([1, 2, 3], extra))).device_indices,
                                   ids_of(value))
    assert len(cache.match_prefix(MatchPrefixParams(key=key([1, 2, 3], "nonexistent"))).device_indices) == 0
    check(cache)


@pytest.mark.parametrize("impl", IMPLS)
def test_lock_ref_operations(impl):
    cache = simulated(impl)
    cache.insert(InsertParams(key=key([1, 2, 3]), value=ids_of([10, 20, 30])))
    node = cache.match_prefix(MatchPrefixParams(key=key([1, 2, 3]))).last_device_node
    evictable, protected = cache.evictable_size(), cache.protected_size()
    cache.inc_lock_ref(node)
    assert (cache.protected_size(), cache.evictable_size()) == (protected + 3, evictable - 3)
    cache.dec_lock_ref(node)
    assert (cache.protected_size(), cache.evictable_size()) == (protected, evictable)
    check(cache)


@pytest.mark.parametrize("impl", IMPLS)
def test_evict_functionality(impl):
    alloc = real_allocator()
    cache = simulated(impl, mock_allocator=alloc)
    cache.insert(InsertParams(key=key([1, 2]), value=alloc.alloc(2)))
    cache.insert(InsertParams(key=key([3, 4]), value=alloc.alloc(2)))
    size, available = cache.total_size(), alloc.available_size()
    # SGLang's test asserts its RadixCache's free_segment call; at page 1 kvcore-radix frees a run of
    # evicted leaves with one free, the same free-list order: either way SGLang's allocator takes them back.
    with unittest.mock.patch.object(alloc, "free_segment", wraps=alloc.free_segment) as free_segment, \
            unittest.mock.patch.object(alloc, "free", wraps=alloc.free) as free:
        result = cache.evict(EvictParams(num_tokens=2))
    assert isinstance(result, EvictResult) and result.num_tokens_evicted >= 2
    assert free_segment.called or free.called
    assert alloc.available_size() == available + result.num_tokens_evicted
    assert cache.total_size() < size
    assert alloc.available_size() + cache.evictable_size() == 32
    check(cache)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(("page_size", "length"), [(1, 5), (2, 5), (4, 6)])
def test_page_alignment_boundary(impl, page_size, length):
    cache = simulated(impl, page_size=page_size)
    tokens = list(range(length))
    cache.insert(InsertParams(key=key(tokens), value=ids_of(tokens)))
    found = cache.match_prefix(MatchPrefixParams(key=key(tokens)))
    assert len(found.device_indices) > 0 and len(found.device_indices) % page_size == 0
    assert cache.total_size() == length // page_size * page_size
    check(cache)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("page_size", [1, 2])
def test_advanced_prefix_match_with_node_splits(impl, page_size):
    cache = simulated(impl, page_size=page_size)
    seq1 = [1, 2, 3, 4, 5, 6, 7, 8]
    val1 = ids_of([x * 10 for x in seq1])
    cache.insert(InsertParams(key=key(seq1), value=val1))
    seq2 = [1, 2, 9, 10]
    val2 = ids_of([x * 10 for x in seq2])
    cache.insert(InsertParams(key=key(seq2), value=val2))
    assert cache.total_size() == 10
    torch.testing.assert_close(cache.match_prefix(MatchPrefixParams(key=key([1, 2, 3, 4, 999, 1000]))).device_indices,
                               val1[:4])
    assert cache.total_size() == 10
    torch.testing.assert_close(cache.match_prefix(MatchPrefixParams(key=key(seq1))).device_indices, val1)
    torch.testing.assert_close(
        cache.match_prefix(MatchPrefixParams(key=key([1, 2, 3, 4, 5, 6, 777, 888]))).device_indices, val1[:6])
    assert cache.total_size() == 10
    torch.testing.assert_close(cache.match_prefix(MatchPrefixParams(key=key(seq2))).device_indices, val2)
    check(cache)


@pytest.mark.parametrize("impl", IMPLS)
def test_hash_value_repeating_tokens(impl):
    """Block hashes chain on the parent's: a repeated page has another hash."""
    cache = simulated(impl, page_size=4, enable_kv_cache_events=True)
    cache.insert(InsertParams(key=key([1, 2, 3, 4, 1, 2, 3, 4]), value=None))
    stored = [e for e in cache.take_events() if isinstance(e, BlockStored)]
    # SGLang 0.5.19: one event for the node's two pages.
    assert len(stored) == 1 and stored[0].parent_block_hash is None
    first, second = stored[0].block_hashes
    assert first != second
    check(cache)


def test_sglang_events_and_answers_are_the_same():
    """Beyond SGLang's assertions: both trees answer every call of a mixed sequence alike, events included."""
    answers = []
    for impl in IMPLS:
        cache = simulated(impl, page_size=2, enable_kv_cache_events=True)
        out = []
        for ids, extra in (([1, 2, 3, 4, 5], None), ([1, 2, 3, 9], None), ([1, 2, 3, 4, 5, 6, 7], "x"),
                           ([1, 2, 7, 8], None), ([1, 2, 3, 4, 5, 6], None)):
            done = cache.insert(InsertParams(key=key(ids, extra), value=None, priority=1))
            out.append((done.prefix_len, cache.total_size(), cache.evictable_size()))
            out.append(cache.match_prefix(MatchPrefixParams(key=key(ids, extra))).device_indices.tolist())
        out.append([repr(e) for e in cache.take_events()])
        answers.append(out)
        check(cache)
    assert answers[0] == answers[1]


# ---------------------------------------------------------------------------- insert on SGLang's pools


def both_worlds(world: type[World], cache_kind: str, kvcore_name: str, **kw: Any) -> tuple[World, World]:
    return world(cache_kind, **kw), world(cache_kind, kvcore_name=kvcore_name, **kw)


def same(ref: World, ours: World) -> None:
    s0, s1 = ref.state(), ours.state()
    for field in s1:
        assert s0[field] == s1[field], f"{field}: SGLang {s0[field]} kvcore {s1[field]}"
    for w in (ref, ours):
        w.check_memory()


def answers(result: Any) -> tuple:
    node = result.last_device_node
    return result.prefix_len, result.mamba_exist, None if node is None else type(node).__name__ != "NoneType"


@pytest.mark.parametrize(("cache_kind", "kvcore_name", "page_size"),
                         [("radix", "kvcore-radix", 1), ("radix", "kvcore-radix", 4),
                          ("unified", "kvcore-unified", 1), ("unified", "kvcore-unified", 4),
                          ("chunk", "kvcore-chunk", 1)])
def test_insert_on_sglang_pools_matches_sglang(cache_kind, kvcore_name, page_size):
    ref, ours = both_worlds(World, cache_kind, kvcore_name, size=64, page_size=page_size, rows=4, width=64)
    a = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]
    b = a[:6] + [7, 7, 7, 7, 7, 7]
    for ids in (a, b, a + [2, 7]):
        results = []
        for w in (ref, ours):
            value = w.alloc.alloc(len(ids) // page_size * page_size)
            done = w.cache.insert(InsertParams(key=key(ids), value=value, priority=2))
            results.append(answers(done))
            if cache_kind == "radix":
                # SGLang's RadixCache leaves the caller's copy of the cached part to the caller.
                w.alloc.free(value[:done.prefix_len])
            elif cache_kind == "chunk":
                w.alloc.free(value)
        assert results[0] == results[1]
        same(ref, ours)
    for w in (ref, ours):
        done = w.cache.evict(EvictParams(num_tokens=page_size))
        results.append(done.num_tokens_evicted)
    assert results[-2] == results[-1]
    same(ref, ours)


def test_kvcore_unified_total_size_is_sglang_pair():
    """SGLang's ``UnifiedRadixCache`` answers ``total_size()`` as (full tokens, other components' tokens)."""
    ref, ours = both_worlds(World, "unified", "kvcore-unified", size=64, page_size=1, rows=4, width=64)
    assert isinstance(ours.cache, KvcoreUnifiedTreeCache)
    assert ref.cache.total_size() == ours.cache.total_size() == (0, 0)
    for w in (ref, ours):
        w.cache.insert(InsertParams(key=key([1, 2, 3, 4, 5]), value=w.alloc.alloc(5)))
    assert ref.cache.total_size() == ours.cache.total_size() == (5, 0)
    assert ours.cache.kvcore_cache.total_size() == 5    # kvcore's own API: its full tokens
    same(ref, ours)


def test_insert_on_swa_pools_and_eviction_count_match_sglang():
    """kvcore-swa against SGLang's ``UnifiedRadixCache`` (full + swa): the insert frees the caller's duplicates
    past ``prev_prefix_len``, and each eviction's counts are the pools' gains, on both sides."""
    kw = dict(size=64, page_size=1, rows=4, width=64, swa_size=40, window=4)
    ref, ours = both_worlds(SWAWorld, "unified-swa", "kvcore-swa", **kw)
    a = list(range(1, 17))
    b = list(range(1, 9)) + list(range(21, 29))
    for ids in (a, b):
        results = [w.cache.insert(InsertParams(key=key(ids), value=w.alloc.alloc(16))) for w in (ref, ours)]
        assert results[0].prefix_len == results[1].prefix_len
        assert (results[0].last_device_node is None) == (results[1].last_device_node is None)
        same(ref, ours)
    got = []
    for swa_n in (8, 8, 8):
        row = []
        for w in (ref, ours):
            before = w.alloc.full_available_size()
            done = w.cache.evict(EvictParams(num_tokens=0, swa_num_tokens=swa_n))
            row.append((done.num_tokens_evicted, done.swa_num_tokens_evicted, w.alloc.full_available_size() - before))
        got.append(row)
        same(ref, ours)
        ours.check_memory()
    assert [r[0] for r in got] == [r[1] for r in got]
    assert all(r[0][0] == r[0][2] for r in got)  # SGLang's unified tree counts what the full pool gained
    assert sum(r[0][1] for r in got) == 24


def test_insert_value_none_is_refused_on_pools():
    ours = SWAWorld("unified-swa", kvcore_name="kvcore-swa", size=64, page_size=1, rows=4, width=64, swa_size=40,
                    window=4)
    before = ours.state()
    with pytest.raises(ValueError, match="value=None"):
        ours.cache.insert(InsertParams(key=key([1, 2, 3]), value=None))
    assert ours.state() == before


def test_insert_on_mamba_pools_matches_sglang():
    """kvcore-mamba against ``UnifiedRadixCache`` (full + mamba): ``mamba_value`` kept at the key's end;
    ``mamba_exist`` when cached."""
    ref, ours = both_worlds(MambaWorld, "unified-mamba", "kvcore-mamba", size=64, page_size=1, rows=4, width=64,
                            mamba_size=8, chunk_size=4)
    for ids in ([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6], [1, 2, 3, 9, 9]):
        results = []
        for w in (ref, ours):
            state = w.r2t.mamba_allocator.alloc(1)
            done = w.cache.insert(InsertParams(key=key(ids), value=w.alloc.alloc(len(ids)), mamba_value=state))
            results.append((done.prefix_len, done.mamba_exist))
            if done.mamba_exist:
                # The tree had a state there: the offered one stays the caller's.
                w.r2t.mamba_allocator.free(state)
        assert results[0] == results[1]
        same(ref, ours)


class _Metrics:
    """Stands for SGLang's eviction metrics collector: records what ``update_eviction_metrics`` is told."""

    def __init__(self) -> None:
        self.evicted: list[int] = []

    def observe_eviction_duration(self, duration: float) -> None:
        pass

    def increment_eviction_num_tokens(self, num_tokens: int) -> None:
        self.evicted.append(num_tokens)


@pytest.mark.parametrize(("world", "cache_kind", "kvcore_name", "kw"), [
    (World, "unified", "kvcore-unified", {}),
    (SWAWorld, "unified-swa", "kvcore-swa", {"swa_size": 40, "window": 4}),
    (SWAWorld, "unified-swa", "kvcore-unified", {"swa_size": 40, "window": 4}),
    (MambaWorld, "unified-mamba", "kvcore-mamba", {"mamba_size": 8, "chunk_size": 4}),
    (MambaWorld, "unified-mamba", "kvcore-unified", {"mamba_size": 8, "chunk_size": 4}),
])
def test_unified_answers_outside_the_request_path_match_sglang(world, cache_kind, kvcore_name, kw):
    """Sizes, ``total_size()``, the flattened values, ``available_and_evictable_str()`` and the eviction metrics
    (full tokens only) of every component set, as SGLang's ``UnifiedRadixCache`` answers them."""
    ref, ours = both_worlds(world, cache_kind, kvcore_name, size=64, page_size=1, rows=4, width=64, **kw)

    def answered(w: World) -> tuple:
        c = w.cache
        sizes = (c.evictable_size(), c.protected_size(), c.full_evictable_size(), c.full_protected_size(),
                 c.swa_evictable_size(), c.total_size())
        if c.supports_mamba():
            sizes += (c.mamba_evictable_size(), c.mamba_protected_size())
        flat = (sorted(c.all_values_flatten().tolist()), sorted(c.all_mamba_values_flatten().tolist()))
        return (c.supports_swa(), c.supports_mamba(), c.is_chunk_cache(), sizes, flat, c.available_and_evictable_str())

    assert answered(ref) == answered(ours)
    for ids in ([1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9]):
        for w in (ref, ours):
            extra = {"mamba_value": w.r2t.mamba_allocator.alloc(1)} if world is MambaWorld else {}
            done = w.cache.insert(InsertParams(key=key(ids), value=w.alloc.alloc(len(ids)), **extra))
            if done.mamba_exist:
                w.r2t.mamba_allocator.free(extra["mamba_value"])
        assert answered(ref) == answered(ours)
        same(ref, ours)
    counted = []
    for w in (ref, ours):
        w.cache.metrics_collector = _Metrics()
        done = w.cache.evict(EvictParams(num_tokens=4, mamba_num=1 if world is MambaWorld else 0))
        counted.append((done.num_tokens_evicted, done.swa_num_tokens_evicted, done.mamba_num_evicted,
                        w.cache.metrics_collector.evicted))
    assert counted[0] == counted[1] and counted[0][0] > 0 and counted[0][3] == [counted[0][0]]
    assert answered(ref) == answered(ours)
    same(ref, ours)

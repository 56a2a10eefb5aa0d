"""Unit tests of the swa plugin: registration, options, errors, locks, events, reset."""


import dataclasses

import pytest
import torch

import kvcore
from kvcore import InvariantChecker, Req, create_cache
from kvcore.factory import build_pools
from kvcore.testing.swa import SWAEngine
from kvcore.tree.unified import UnifiedRadixCache
from kvcore_swa import SWAChunkCache, SWAComponent, SWAConfig


def make(name="swa", **kw):
    opts = dict(size=1024, swa_size=256, sliding_window_size=8, page_size=1, max_num_reqs=8, max_context_len=512)
    opts.update(kw)
    return create_cache(name, **opts)


def check(cache, owners=()):
    InvariantChecker(cache).check(owners=list(owners))
    if hasattr(cache, "sanity_check"):
        cache.sanity_check()


# ---------------------------------------------------------------- registration and options


def test_backends_are_registered_by_the_swa_distribution():
    backends = kvcore.available_backends()
    for name, cls in (("swa", UnifiedRadixCache), ("swa-chunk", SWAChunkCache)):
        spec = backends[name]
        assert isinstance(make(name), cls) and spec.distribution == "kvcore-swa" and spec.description
    # ``swa`` is the core's one tree with components (full, swa); the window component is this distribution's.
    assert kvcore.components.get_component("swa").factory is SWAComponent
    assert kvcore.components.get_component("swa").distribution == "kvcore-swa"


@pytest.mark.parametrize("name", ["swa", "swa-chunk"])
def test_built_cache_exposes_window_and_pools(name):
    cache = make(name, page_size=4, size=512, swa_size=64, sliding_window_size=10)
    assert cache.sliding_window_size == 10 and set(cache.cached_sizes()) == {"full", "swa"}
    a = cache.token_to_kv_pool_allocator
    assert a.size_full == 512 and a.size_swa == 64 and cache.page_size == 4
    assert cache.is_chunk_cache() == (name == "swa-chunk")
    check(cache)


def test_swa_size_defaults_to_size():
    cache = create_cache("swa", size=256, sliding_window_size=16)
    assert cache.token_to_kv_pool_allocator.size_swa == 256


@pytest.mark.parametrize("name", ["swa", "swa-chunk"])
@pytest.mark.parametrize(
    "opts, match",
    [
        (dict(sliding_window_size=0), "sliding_window_size must be a positive"),
        (dict(sliding_window_size=-4), "sliding_window_size must be a positive"),
        (dict(sliding_window_size=64, swa_size=64), "cannot hold one request's window"),
        (
            dict(page_size=16, sliding_window_size=32, swa_size=50, size=512, max_context_len=512),
            "not a multiple of page_size",
        ),
        (dict(page_size=16, size=500), "not a multiple of page_size"),
        (dict(bogus=1), r"unknown option(\(s\))? 'bogus'"),
    ],
)
def test_bad_options_are_rejected_with_clear_messages(name, opts, match):
    with pytest.raises(kvcore.ConfigError, match=match) as info:
        make(name, **opts)
    assert repr(name) in str(info.value)


def test_only_lru_eviction_policy():
    with pytest.raises(kvcore.ConfigError, match="the swa backend takes eviction_policy 'lru' only"):
        make(eviction_policy="lfu")
    assert make(eviction_policy="lru").eviction_policy == "lru"


def test_swa_backends_need_an_swa_allocator():
    cfg = kvcore.CacheConfig(size=64)
    params = build_pools("chunk", cfg)
    swa_params = dataclasses.replace(params, config=SWAConfig(size=64, sliding_window_size=8))
    with pytest.raises(TypeError, match="SWATokenToKVPoolAllocator"):
        UnifiedRadixCache(swa_params)
    with pytest.raises(TypeError, match="SWATokenToKVPoolAllocator"):
        SWAChunkCache(params)


def test_config_builds_the_hybrid_allocator():
    cfg = SWAConfig(size=128, swa_size=32, sliding_window_size=4, page_size=2, max_context_len=64)
    alloc = build_pools("swa", cfg).token_to_kv_pool_allocator
    assert isinstance(alloc, kvcore.SWATokenToKVPoolAllocator)
    assert (alloc.size_full, alloc.size_swa, alloc.page_size) == (128, 32, 2)


# ---------------------------------------------------------------- keys and errors


def test_bad_keys_raise_and_change_nothing():
    cache = make()
    eng = SWAEngine(cache)
    eng.finish(eng.run(list(range(20)), rid="x"))
    sizes = cache.cached_sizes()
    for key, exc in (([1.5, 2], TypeError), ([-1, 3], ValueError), ("abc", TypeError), (torch.zeros(2, 2), TypeError)):
        with pytest.raises(exc):
            cache.match_prefix(key)
        with pytest.raises(exc):
            cache.insert(key, torch.arange(1, 3))
    assert cache.cached_sizes() == sizes
    check(cache)


def test_keys_are_page_aligned():
    cache = make(page_size=4, sliding_window_size=4, size=256, swa_size=64)
    a = cache.token_to_kv_pool_allocator
    slots = a.alloc(12)
    res = cache.insert(list(range(11)), slots[:11])
    assert res.prefix_len == 0 and cache.total_size() == 8
    a.free(slots[8:])  # the unaligned tail was not taken
    assert cache.match_prefix(list(range(11))).prefix_len == 8
    assert cache.match_prefix(list(range(3))).prefix_len == 0
    assert cache.match_prefix(torch.arange(9)).prefix_len == 8
    check(cache)


def test_insert_without_value_allocates_slots():
    cache = make()
    res = cache.insert(list(range(10)))
    assert res.prefix_len == 0 and cache.total_size() == 10 and cache.swa_total_size() == 10
    assert cache.insert(list(range(12))).prefix_len == 10  # duplicate part freed again
    assert cache.total_size() == 12
    check(cache)


def test_lock_errors_leave_the_tree_unchanged():
    cache = make()
    other = make()
    eng = SWAEngine(cache)
    eng.finish(eng.run(list(range(20)), rid="x"))
    node = cache.match_prefix(list(range(20))).last_device_node
    sizes = cache.cached_sizes()
    with pytest.raises(ValueError, match="not locked"):
        cache.dec_lock_ref(node)
    with pytest.raises(ValueError, match="not in this cache"):
        other.inc_lock_ref(node)
    with pytest.raises(TypeError):
        cache.inc_lock_ref("node")
    lock = cache.inc_lock_ref(node)
    with pytest.raises(ValueError):
        cache.dec_swa_lock_only(node, kvcore.LockResult(0, stop=-5, extras={"swa_tokens": 1}))
    cache.dec_lock_ref(node, lock)
    with pytest.raises(ValueError, match="already given back"):
        cache.dec_lock_ref(node, lock)
    assert cache.cached_sizes() == sizes
    cache.evict(100, 100)
    with pytest.raises(ValueError, match="not in this cache"):
        cache.inc_lock_ref(node)  # evicted
    check(cache)


def test_lock_without_lock_result_uses_the_window_rule():
    cache = make(sliding_window_size=4)
    eng = SWAEngine(cache)
    key = list(range(12))
    eng.finish(eng.run(key, rid="a"))
    eng.finish(eng.run(key[:4] + [99], rid="b"))
    eng.finish(eng.run(key[:8] + [99], rid="c"))
    node = cache.match_prefix(key).last_device_node
    lock = cache.inc_lock_ref(node)
    assert cache.swa_protected_size() == 4 and cache.full_protected_size() == 12
    assert lock.stop is not None and lock.delta == 12
    res = cache.dec_lock_ref(node)
    assert res.delta == -12 and res.extras["swa_delta"] == -4
    assert cache.swa_protected_size() == 0 and cache.full_protected_size() == 0
    check(cache)


def test_root_and_none_locks_are_no_ops():
    cache = make()
    for node in (None, cache.root_node):
        assert cache.inc_lock_ref(node).delta == 0
        assert cache.dec_lock_ref(node).delta == 0
    check(cache)


# ---------------------------------------------------------------- tree behaviour details


def test_early_window_unlock_of_a_leaf_makes_its_window_evictable():
    cache = make(sliding_window_size=4)
    eng = SWAEngine(cache)
    eng.finish(eng.run(list(range(8)), rid="a"))  # two 4-token nodes: a new leaf is cut at one window
    node = cache.match_prefix(list(range(8))).last_device_node
    lock = cache.inc_lock_ref(node)
    assert cache.cached_sizes() == {"full": (0, 8), "swa": (4, 4)}
    alloc = cache.token_to_kv_pool_allocator
    swa_free = alloc.swa_available_size()
    cache.dec_swa_lock_only(node, lock)
    # The full lock still holds the leaf: its window slots stay, evictable (SGLang's unified tree).
    assert alloc.swa_available_size() == swa_free
    assert cache.cached_sizes() == {"full": (0, 8), "swa": (8, 0)}
    check(cache)
    res = cache.evict(0, 8)  # window eviction may take them now, the full lock keeps the full slots
    assert (res.num_tokens_evicted, res.swa_num_tokens_evicted) == (0, 8)
    assert alloc.swa_available_size() == swa_free + 8 and cache.swa_total_size() == 0
    check(cache)
    # Dropping the full lock leaves evictable stateless nodes (as SGLang); full eviction takes them.
    cache.dec_lock_ref(node, lock)
    assert cache.total_size() == 8 and cache.full_evictable_size() == 8 and cache.swa_total_size() == 0
    check(cache)
    full_free = alloc.full_available_size()
    assert cache.evict(8, 0).num_tokens_evicted == 8
    assert cache.total_size() == 0
    assert alloc.full_available_size() == full_free + 8
    check(cache)


def test_unfinished_req_moves_its_lock_and_protects_the_prefix():
    cache = make(sliding_window_size=4)
    eng = SWAEngine(cache)
    req = eng.admit(Req("r", list(range(30))))
    eng.prefill(req, chunk=8)
    assert req.kv.cache_protected_len == 24
    # The window lock holds one window (4 tokens) of the request's last node, the full lock its path.
    assert cache.full_protected_size() == 24 and cache.swa_protected_size() == 4
    # prefix_indices were set by the last cache_unfinished_req (after 24 tokens).
    assert torch.equal(req.prefix_indices, cache.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :24].long())
    eng.check()
    eng.finish(req)
    assert cache.full_protected_size() == 0 and cache.total_size() == 30
    eng.check()


def test_kv_events_follow_stores_and_removals():
    cache = make(enable_kv_events=True, page_size=4, sliding_window_size=4, size=256, swa_size=64)
    eng = SWAEngine(cache)
    eng.finish(eng.run(list(range(16)), rid="a"))
    events = cache.take_events()
    assert [e.kind for e in events] == ["stored"] * 4
    assert events[0].parent_hash is None and events[1].parent_hash == events[0].page_hash
    cache.evict(100)
    assert [e.kind for e in cache.take_events()] == ["removed"] * 4
    cache.reset()
    assert [e.kind for e in cache.take_events()] == ["cleared"]
    check(cache)


def test_reset_frees_everything_including_tombstones():
    cache = make(sliding_window_size=4)
    eng = SWAEngine(cache)
    key = list(range(16))
    eng.finish(eng.run(key, rid="a"))
    eng.finish(eng.run(key[:8] + [77] * 4, rid="b"))
    node_a = cache.match_prefix(key).last_device_node
    node_b = cache.match_prefix(key[:8] + [77] * 4).last_device_node
    la, lb = cache.inc_lock_ref(node_a), cache.inc_lock_ref(node_b)
    # Each lock holds one window (4 tokens): the shared [0, 8) and a's [8, 12) are window-evicted.
    assert cache.evict(0, 8).swa_num_tokens_evicted == 12
    cache.dec_lock_ref(node_a, la)
    cache.dec_lock_ref(node_b, lb)
    assert cache.total_size() == 20 and cache.swa_total_size() == 8
    cache.reset()
    a = cache.token_to_kv_pool_allocator
    assert a.full_available_size() == a.size_full and a.swa_available_size() == a.size_swa
    check(cache)


def test_disabled_cache_matches_and_keeps_nothing():
    cache = make(disable=True)
    eng = SWAEngine(cache)
    r = eng.run(list(range(20)), list(range(30)), rid="a")
    eng.finish(r)
    assert cache.total_size() == 0 and cache.match_prefix(list(range(20))).prefix_len == 0
    assert cache.insert(list(range(5)), torch.arange(1, 6)).prefix_len == 0
    eng.check()


def test_chunk_cache_frees_on_finish_split_at_the_cursor():
    cache = make("swa-chunk", sliding_window_size=4)
    eng = SWAEngine(cache)
    r = eng.run(list(range(10)), list(range(20)), rid="a")
    assert r.kv.swa_evicted_seqlen == r.seqlen - 4
    a = cache.token_to_kv_pool_allocator
    assert a.size_swa - a.swa_available_size() == 4
    eng.check()
    eng.finish(r)
    assert a.full_available_size() == a.size_full and a.swa_available_size() == a.size_swa
    assert cache.match_prefix(r.fill_ids).prefix_len == 0
    eng.check()


def test_window_lock_stops_at_a_tombstone():
    """A lock taken on a node right below a tombstone covers only what is live."""
    cache = make(sliding_window_size=8)
    a = cache.token_to_kv_pool_allocator
    slots = a.alloc(12)
    a.free_swa(slots[:8])
    node = cache.insert(list(range(12)), slots, swa_evicted_seqlen=8).last_device_node  # [0,8) tombstone
    assert cache.match_prefix(list(range(12))).prefix_len == 0  # only 4 live < W
    lock = cache.inc_lock_ref(node)
    assert cache.swa_protected_size() == 4 and cache.full_protected_size() == 12
    cache.dec_lock_ref(node, lock)
    check(cache)


def test_match_and_insert_on_long_branched_keys():
    # Correctness only: the speed of long-key matches is measured in benchmarks/bench_swa.py, never asserted here.
    cache = make(size=1 << 16, swa_size=1 << 15, max_context_len=1 << 15, sliding_window_size=128)
    a = cache.token_to_kv_pool_allocator
    key = list(range(20000))
    cache.insert(key, a.alloc(20000))
    for i in range(1, 50):  # 49 branches off one long prefix
        k = key[: 400 * i] + [10**6 + i] * 4
        cache.insert(k, torch.cat([cache.match_prefix(k).device_indices, a.alloc(4)]), prev_prefix_len=400 * i)
    m = cache.match_prefix(key)
    assert m.prefix_len == 20000
    for i in range(1, 50):
        assert cache.match_prefix(key[: 400 * i] + [10**6 + i] * 4).prefix_len == 400 * i + 4
    check(cache)


@pytest.mark.parametrize("name", ["swa", "swa-chunk"])
def test_finish_returns_window_slots_under_an_evict_floor(name):
    """Prefill-aware SWA: the cursor jumps over [protected, swa_evict_floor) without freeing
    those window slots; finishing gives them back (nothing leaks in either pool)."""
    cache = make(name, sliding_window_size=4, size=1024, swa_size=256)
    eng = SWAEngine(cache)
    r = eng.admit(Req("f", list(range(20))))
    r.kv.swa_evict_floor = 20
    eng.prefill(r)
    for t in range(30):
        eng.decode(r, t)
    assert r.kv.swa_evicted_seqlen == 46
    eng.finish(r)
    eng.check()
    cache.evict(10**6, 10**6)
    a = cache.token_to_kv_pool_allocator
    assert a.full_available_size() == a.size_full and a.swa_available_size() == a.size_swa
    eng.check()


# ---------------------------------------------------------------- core API: pools by name, room, window frees


def test_cached_sizes_name_both_pools():
    cache = make(sliding_window_size=4)
    eng = SWAEngine(cache)
    eng.finish(eng.run(list(range(12)), rid="a"))
    node = cache.match_prefix(list(range(12))).last_device_node
    lock = cache.inc_lock_ref(node)
    assert cache.cached_sizes() == {
        "full": (cache.full_evictable_size(), cache.full_protected_size()),
        "swa": (cache.swa_evictable_size(), cache.swa_protected_size()),
    }
    # The 12-token insert is two nodes, the leaf cut at one window (4): the window lock holds that leaf.
    assert cache.cached_sizes() == {"full": (0, 12), "swa": (8, 4)}
    cache.dec_lock_ref(node, lock)
    assert make("swa-chunk").cached_sizes() == {"full": (0, 0), "swa": (0, 0)}


def test_insert_reports_that_it_freed_the_duplicates():
    cache = make()
    alloc = cache.token_to_kv_pool_allocator
    first = cache.insert(list(range(8)), alloc.alloc(8))
    assert first.prefix_len == 0 and first.duplicates_freed
    before = alloc.full_available_size(), alloc.swa_available_size()
    again = cache.insert(list(range(8)), alloc.alloc(8))
    assert again.prefix_len == 8 and again.duplicates_freed
    # The second copy went straight back: both pools are where they were.
    assert (alloc.full_available_size(), alloc.swa_available_size()) == before
    check(cache)


@pytest.mark.parametrize("name", ["swa", "swa-chunk"])
def test_make_room_evicts_each_pools_shortfall(name):
    cache = make(name, size=64, swa_size=32, sliding_window_size=8)
    alloc = cache.token_to_kv_pool_allocator
    assert (cache.make_room(16).num_tokens_evicted, cache.make_room(16).swa_num_tokens_evicted) == (0, 0)
    if name == "swa-chunk":
        return
    eng = SWAEngine(cache)
    for i in range(2):
        eng.finish(eng.run([100 * i + t for t in range(12)], rid=f"r{i}"))
    assert alloc.swa_available_size() == 8 and alloc.full_available_size() == 40
    res = cache.make_room(16)
    # The window pool was 8 short and the full pool was not: one leaf, evicted from both.
    assert res.swa_num_tokens_evicted >= 8 and alloc.swa_available_size() >= 16
    assert alloc.full_available_size() >= 16
    check(cache)


def test_free_window_slots_frees_what_left_the_window():
    cache = make(sliding_window_size=4)
    eng = SWAEngine(cache)
    req = eng.run(list(range(20)), rid="a")
    alloc = cache.token_to_kv_pool_allocator
    swa_free, cursor = alloc.swa_available_size(), req.kv.swa_evicted_seqlen
    # A tree keeps max(window, page) tokens: the cursor moves to 20 - 4.
    released = cache.free_window_slots([req])
    assert released == 16 - cursor and req.kv.swa_evicted_seqlen == 16
    assert alloc.swa_available_size() == swa_free + released
    assert cache.free_window_slots([req], [20]) == 0  # nothing more left the window
    eng.finish(req)
    check(cache)


def test_swa_plugin_stands_alone():
    import pathlib
    import subprocess
    import sys
    from importlib.metadata import version

    tomllib = pytest.importorskip("tomllib")

    import kvcore_swa

    assert kvcore_swa.__version__ == version("kvcore-swa")
    pyproject = pathlib.Path(__file__).parents[1] / "pyproject.toml"
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    assert not any(d.startswith("kvcore-") for d in deps), deps
    code = "import sys, kvcore_swa; kvcore_swa.SWAComponent; assert 'kvcore_radix' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)

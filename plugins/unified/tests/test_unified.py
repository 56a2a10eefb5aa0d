"""Where the unified tree differs from the legacy ones once anything is evicted, shown on small trees.

(The differential tests check the same against SGLang's own class on random runs.)
"""

from __future__ import annotations

import pytest
import torch

import kvcore
from kvcore import InvariantChecker, RadixKey


def _swa(window=4, **kw):
    return kvcore.create_cache("unified", components=("full", "swa"), size=128, swa_size=64,
                               sliding_window_size=window, max_num_reqs=4, max_context_len=64, **kw)


def test_leaf_takes_every_component_and_stateless_leaves_stay():
    cache = _swa()
    a = cache.token_to_kv_pool_allocator
    key = list(range(12))
    v = a.alloc(12)
    a.free_swa(v[:4])  # [0, 4) left the window
    cache.insert(RadixKey(key), v, 0, 4)
    # [0,4) window tombstone, [4,8) and [8,12) live (the new leaf is cut at one window).
    assert cache.cached_sizes() == {"full": (12, 0), "swa": (8, 0)}
    res = cache.evict(0, swa_num_tokens=4)
    # The window LRU's oldest is [4,8) (internal): tombstoned, full kept.
    assert (res.num_tokens_evicted, res.swa_num_tokens_evicted) == (0, 4)
    res = cache.evict(0, swa_num_tokens=4)
    # Now the leaf [8,12): it goes whole (full and window: one shared quota).
    assert (res.num_tokens_evicted, res.swa_num_tokens_evicted) == (4, 4)
    # [0, 8) stays as a leaf holding only full slots (SGLang keeps stateless leaves).
    assert cache.cached_sizes() == {"full": (8, 0), "swa": (0, 0)}
    assert cache.match_prefix(RadixKey(key)).prefix_len == 0  # no window left on the path
    cache.sanity_check()
    InvariantChecker(cache).check([])
    assert cache.evict(100).num_tokens_evicted == 8
    assert a.full_available_size() == 128 and a.swa_available_size() == 64


def test_internal_drop_cascades_to_lower_priority_only():
    cache = kvcore.create_cache("unified", components=("full", "swa", "mamba"), size=128, swa_size=64,
                                sliding_window_size=8, max_num_reqs=4, max_context_len=64, mamba_size=8)
    a = cache.token_to_kv_pool_allocator
    mp = cache.mamba_pool
    cache.insert(RadixKey([1, 2, 3, 4]), a.alloc(4), mamba_value=mp.alloc(1))
    cache.insert(RadixKey([1, 2, 3, 4, 5, 6]), a.alloc(6), mamba_value=mp.alloc(1))
    assert cache.cached_sizes() == {"full": (6, 0), "swa": (6, 0), "mamba": (2, 0)}
    # Dropping the window from the internal node [1..4] (priority 1) takes its state (priority 0) too.
    res = cache.evict(0, swa_num_tokens=1)
    assert (res.num_tokens_evicted, res.swa_num_tokens_evicted, res.mamba_num_evicted) == (0, 4, 1)
    (internal,) = cache.root_node.children.values()
    assert internal.swa_value is None and internal.mamba_value is None and internal.value is not None
    (leaf,) = internal.children.values()
    assert leaf.swa_value is not None and leaf.mamba_value is not None
    # Dropping a state from an internal node leaves its window alone (nothing is below priority 0).
    cache2 = kvcore.create_cache("unified", components=("full", "swa", "mamba"), size=128, swa_size=64,
                                 sliding_window_size=8, max_num_reqs=4, max_context_len=64, mamba_size=8)
    a2, mp2 = cache2.token_to_kv_pool_allocator, cache2.mamba_pool
    cache2.insert(RadixKey([1, 2]), a2.alloc(2), mamba_value=mp2.alloc(1))
    cache2.insert(RadixKey([1, 2, 3, 4]), a2.alloc(4), mamba_value=mp2.alloc(1))
    m = cache2.match_prefix(RadixKey([1, 2, 3, 4]))
    lock = cache2.inc_lock_ref(m.last_device_node)  # the leaf's state is locked: the internal one goes
    res = cache2.evict(0, mamba_num=1)
    assert res.mamba_num_evicted == 1 and res.swa_num_tokens_evicted == 0
    top = m.last_device_node.parent
    assert top.mamba_value is None and top.swa_value is not None
    cache2.dec_lock_ref(m.last_device_node, lock)
    for c in (cache, cache2):
        c.sanity_check()
        InvariantChecker(c).check([])


def test_bad_input_changes_nothing():
    cache = _swa()
    a = cache.token_to_kv_pool_allocator
    v = a.alloc(4)
    before = (a.full_available_size(), a.swa_available_size(), cache.cached_sizes())
    with pytest.raises(ValueError, match="prev_prefix_len"):
        cache.insert(RadixKey([1, 2, 3, 4]), v, -1)
    with pytest.raises(ValueError, match="slots but the key"):
        cache.insert(RadixKey([1, 2, 3, 4]), v[:2])
    with pytest.raises(TypeError):
        cache.insert(RadixKey([1, 2, 3, 4]), torch.zeros(4))
    with pytest.raises(ValueError):
        cache.insert(RadixKey([1, -2, 3, 4]), v)
    with pytest.raises(ValueError):
        cache.evict(-1)
    assert (a.full_available_size(), a.swa_available_size(), cache.cached_sizes()) == before
    a.free(v)
    InvariantChecker(cache).check([])


def test_config_errors_name_the_field():
    with pytest.raises(kvcore.ConfigError, match="swa_size=10 cannot hold one request's window"):
        kvcore.create_cache("unified", components=("full", "swa"), size=64, swa_size=10, sliding_window_size=16)
    with pytest.raises(kvcore.ConfigError, match="'mamba_size' of component 'mamba'"):
        kvcore.create_cache("unified", components=("full", "mamba"), mamba_size=0)
    with pytest.raises(kvcore.ConfigError, match="names a component twice"):
        kvcore.create_cache("unified", components=("full", "swa", "swa"))
    with pytest.raises(kvcore.ConfigError, match="eviction_policy"):
        kvcore.create_cache("unified", eviction_policy="lfu")
    c = kvcore.create_cache("unified-swa", size=64, swa_size=64, sliding_window_size=8)
    assert c.sliding_window_size == 8 and set(c.cached_sizes()) == {"full", "swa"}


COMPONENT_SETS = [("full",), ("full", "swa"), ("full", "mamba"), ("full", "swa", "mamba")]


def _cache_of(components):
    opts = dict(size=128, max_num_reqs=4, max_context_len=64)
    if "swa" in components:
        opts.update(swa_size=64, sliding_window_size=4)
    if "mamba" in components:
        opts.update(mamba_size=8)
    cache = kvcore.create_cache("unified", components=components, **opts)
    extra = {"mamba_value": cache.mamba_pool.alloc(1)} if "mamba" in components else {}
    cache.insert(RadixKey(list(range(1, 9))), cache.token_to_kv_pool_allocator.alloc(8), **extra)
    return cache


def _state(cache):
    return ({v.name: v.available() for v in cache.pools()}, cache.cached_sizes(), cache.protected_size())


@pytest.mark.parametrize("components", COMPONENT_SETS, ids="+".join)
def test_dec_swa_lock_only_on_a_node_without_a_window_lock_is_refused(components):
    # As the swa backend: an unlocked node holds no window lock, on every component set.
    cache = _cache_of(components)
    node = cache.match_prefix(RadixKey(list(range(1, 9)))).last_device_node
    before = _state(cache)
    error = ValueError if "swa" in components else NotImplementedError
    with pytest.raises(error, match=r"dec_swa_lock_only: .* holds no window lock to give back.*nothing was changed"):
        cache.dec_swa_lock_only(node)
    assert _state(cache) == before
    cache.sanity_check()
    InvariantChecker(cache).check([])


@pytest.mark.parametrize("components", [c for c in COMPONENT_SETS if "swa" in c], ids="+".join)
def test_dec_swa_lock_only_twice_is_refused_with_or_without_the_lock(components):
    cache = _cache_of(components)
    node = cache.match_prefix(RadixKey(list(range(1, 9)))).last_device_node
    lock = cache.inc_lock_ref(node)
    assert cache.swa_protected_size() > 0
    cache.dec_swa_lock_only(node, lock)
    assert cache.swa_protected_size() == 0
    before = _state(cache)
    with pytest.raises(ValueError, match="already given back"):
        cache.dec_swa_lock_only(node, lock)
    with pytest.raises(ValueError, match="holds no window lock to give back"):
        cache.dec_swa_lock_only(node)
    assert _state(cache) == before
    cache.dec_lock_ref(node, lock)
    assert cache.protected_size() == 0
    cache.sanity_check()
    InvariantChecker(cache).check([])


def test_an_unknown_option_names_its_component_or_the_nearest_option():
    with pytest.raises(kvcore.ConfigError, match=r"'sliding_window_size' \(an option of component 'swa'\)"):
        kvcore.create_cache("unified", sliding_window_size=8)
    with pytest.raises(kvcore.ConfigError, match=r"'sliding_windw_size' \(did you mean 'sliding_window_size'\?\)"):
        kvcore.create_cache("unified", components=("full", "swa"), sliding_windw_size=8)
    with pytest.raises(kvcore.ConfigError, match=r"'enable_kv_event' \(did you mean 'enable_kv_events'\?\)"):
        kvcore.create_cache("unified", enable_kv_event=True)

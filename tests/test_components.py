"""Tree components as plugins: the ``kvcore_register_components`` hook, the registry, a third party's component.

The third-party component is the guide's example (``examples/kvcore-example-component``,
component ``stamp``): written against the contract in :mod:`kvcore.components` only, it
stamps the last node of every insert; a match may end only on a stamped node; a lock
covers the node itself; its own eviction drops the least recently used stamps
(internal nodes keep their full value, leaves go whole).  Here it runs in the
``unified`` backend's component sets; its own tests run its ``example-component`` backend.
"""

from __future__ import annotations

import pytest
import torch

import kvcore
from kvcore import InvariantChecker, RadixKey, Req
from kvcore.components import available_components, component_failures, get_component, reset_components
from kvcore.plugins import get_plugin_manager

pytest.importorskip("kvcore_swa")  # the swa component and a first-party name to clash with
pytest.importorskip("kvcore_unified")  # the unified backend: any registered component set
stamp = pytest.importorskip("kvcore_example_component")  # the third party's component


class _ClashPlugin:
    @kvcore.hookimpl
    def kvcore_register_components(self, register):
        register("swa", stamp.StampComponent, description="tries to take a first-party name")


def test_hook_kvcore_register_components():
    comps = available_components()
    assert {"full", "swa", "stamp"} <= set(comps)
    assert comps["full"].distribution == "kvcore"
    assert comps["stamp"].distribution == "kvcore-example-component"  # through its entry point, like any plugin
    assert comps["stamp"].options is stamp.StampOptions
    assert get_component("stamp").factory is stamp.StampComponent
    with pytest.raises(ValueError, match="unknown component 'nope'.*registered components: .*stamp"):
        get_component("nope")


def test_a_first_party_name_is_refused():
    pm = get_plugin_manager()
    pm.register(_ClashPlugin(), name="clash-plugin")
    reset_components()
    try:
        assert get_component("swa").distribution == "kvcore-swa"
        assert any("'swa'" in f.error and "refused" in f.error for f in component_failures())
    finally:
        pm.unregister(name="clash-plugin")
        reset_components()


def test_component_options_are_validated_per_component():
    with pytest.raises(kvcore.ConfigError, match="stamp_limit.*component 'stamp'"):
        kvcore.create_cache("unified", components=("full", "stamp"), stamp_limit=0)
    with pytest.raises(kvcore.ConfigError, match="unknown option.*'stamp_limit'.*components"):
        kvcore.create_cache("unified", components=("full",), stamp_limit=3)
    with pytest.raises(kvcore.ConfigError, match="first component must be 'full'"):
        kvcore.create_cache("unified", components=("stamp",))


def test_third_party_component_end_to_end():
    cache = kvcore.create_cache("unified", components=("full", "stamp"), size=256, max_num_reqs=4,
                                max_context_len=64, stamp_limit=50)
    alloc = cache.token_to_kv_pool_allocator
    key = list(range(10))
    cache.insert(RadixKey(key), alloc.alloc(10))
    assert cache.cached_sizes() == {"full": (10, 0), "stamp": (1, 0)}
    # Split the node at 4: the upper half has no stamp, so a match may not end there.
    r = cache.insert(RadixKey(key[:4] + [99, 98]), alloc.alloc(6))
    assert r.prefix_len == 4 and r.duplicates_freed
    assert cache.match_prefix(RadixKey(key[:4])).prefix_len == 0  # unstamped upper half
    m = cache.match_prefix(RadixKey(key))
    assert m.prefix_len == 10
    lock = cache.inc_lock_ref(m.last_device_node)
    assert cache.stamp_protected_size() == 1 and cache.full_protected_size() == 10
    # Evicting stamps: the locked one stays; the other stamped leaf goes whole.
    res = cache.evict(0, stamp=10)
    assert res.num_tokens_evicted == 2 and cache.stamp_evictable_size() == 0
    cache.dec_lock_ref(m.last_device_node, lock)
    cache.sanity_check()
    InvariantChecker(cache).check([])
    # A request runs through it too.
    req = Req("r", key + [7, 7, 7])
    mm = cache.match_request(req, RadixKey(req.origin_input_ids[:-1]))
    cache.req_to_token_pool.alloc([req])
    n = mm.prefix_len
    req.prefix_indices, req.last_node = mm.device_indices, mm.last_device_node
    req.lock = cache.inc_lock_ref(req.last_node)
    row = cache.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
    row[:n] = mm.device_indices.to(torch.int32)
    new = alloc.alloc(len(req.origin_input_ids) - n)
    row[n:len(req.origin_input_ids)] = new.to(torch.int32)
    req.kv.cache_protected_len = n
    req.kv.kv_committed_len = req.kv.kv_allocated_len = len(req.origin_input_ids)
    InvariantChecker(cache).check([req])
    kvcore.release_kv_cache(req, cache)
    InvariantChecker(cache).check([])
    assert cache.evict(10**6).num_tokens_evicted == 13
    assert alloc.available_size() == 256
    InvariantChecker(cache).check([])

"""Tree components as plugins: the ``kvcore_register_components`` hook, the registry, a third party's component.

The third-party component here (``stamp``) is a throwaway written against the
contract in :mod:`kvcore.components` only: every insert stamps its last node with the
node's length; a match may end only on a stamped node; a lock covers the node
itself; its own eviction drops stamps oldest first (internal nodes keep their
full value, leaves go whole).  Registered with pluggy like a distribution would.
"""

from __future__ import annotations

import pytest
import torch
from pydantic import BaseModel, ConfigDict, Field

import kvcore
from kvcore import InvariantChecker, RadixKey, Req
from kvcore.components import TreeComponent, available_components, component_failures, get_component, reset_components
from kvcore.plugins import get_plugin_manager

pytest.importorskip("kvcore_swa")  # the swa component and a first-party name to clash with


class StampOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    stamp_limit: int = Field(1000, gt=0, description="at most this many stamped nodes")


class StampComponent(TreeComponent):
    name = "stamp"
    pool = "stamp"
    internal_priority = 0
    options = StampOptions
    node_fields = {"stamp_value": None, "stamp_lock_ref": 0}

    def reset_state(self) -> None:
        self.stamped: dict[int, object] = {}  # node id -> node, oldest first
        self._ev = self._pr = 0

    def has_value(self, node):
        return node.stamp_value is not None

    def value_len(self, node):
        return 1 if node.stamp_value is not None else 0

    def lock_ref(self, node):
        return node.stamp_lock_ref

    def free_value(self, node):
        if node.stamp_lock_ref:
            self._pr -= 1
        else:
            self._ev -= 1
        node.stamp_value = None
        self.stamped.pop(node.id, None)
        return 1

    def on_split(self, upper, child):
        upper.stamp_value = None  # the stamp stays on the lower half
        upper.stamp_lock_ref = 0

    def on_insert_commit(self, node, is_new_leaf, ins):
        if node is self.cache.root_node or node.stamp_value is not None:
            return
        if len(self.stamped) >= self.opts.stamp_limit:
            return
        node.stamp_value = len(node.key)
        self.stamped[node.id] = node
        self._ev += 1

    def lock(self, node, lock):
        if node.stamp_value is not None:
            if node.stamp_lock_ref == 0:
                self._ev -= 1
                self._pr += 1
            node.stamp_lock_ref += 1
            lock.extras["stamp_node"] = node.id

    def unlock(self, node, lock):
        if lock is not None and lock.extras.get("stamp_node") == node.id and node.stamp_lock_ref:
            node.stamp_lock_ref -= 1
            if node.stamp_lock_ref == 0:
                self._ev += 1
                self._pr -= 1

    def evict(self, target, tracker):
        cache = self.cache
        for node in list(self.stamped.values()):
            if tracker["stamp"] >= target:
                return
            if node.stamp_lock_ref or node.stamp_value is None:
                continue
            if node in cache.leaves:
                cache.delete_leaf(node, tracker)
            else:
                cache.drop_value(node, self, tracker)

    def evictable_size(self):
        return self._ev

    def protected_size(self):
        return self._pr

    def check_totals(self, root):
        from kvcore.tree import iter_subtree

        stamped = [x for x in iter_subtree(root) if x.stamp_value is not None]
        assert len(stamped) == self._ev + self._pr == len(self.stamped)


class _StampPlugin:
    @kvcore.hookimpl
    def kvcore_register_components(self, register):
        register("stamp", StampComponent, options=StampOptions, description="a test's stamp per inserted node")


class _ClashPlugin:
    @kvcore.hookimpl
    def kvcore_register_components(self, register):
        register("swa", StampComponent, description="tries to take a first-party name")


@pytest.fixture
def stamp_plugin():
    pm = get_plugin_manager()
    pm.register(_StampPlugin(), name="stamp-plugin")
    reset_components()
    try:
        yield
    finally:
        pm.unregister(name="stamp-plugin")
        reset_components()


def test_hook_kvcore_register_components(stamp_plugin):
    comps = available_components()
    assert {"full", "swa", "stamp"} <= set(comps)
    assert comps["full"].distribution == "kvcore"
    assert comps["stamp"].options is StampOptions
    assert get_component("stamp").factory is StampComponent
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


def test_component_options_are_validated_per_component(stamp_plugin):
    with pytest.raises(kvcore.ConfigError, match="stamp_limit.*component 'stamp'"):
        kvcore.create_cache("unified", components=("full", "stamp"), stamp_limit=0)
    with pytest.raises(kvcore.ConfigError, match="unknown option.*'stamp_limit'.*components"):
        kvcore.create_cache("unified", components=("full",), stamp_limit=3)
    with pytest.raises(kvcore.ConfigError, match="first component must be 'full'"):
        kvcore.create_cache("unified", components=("stamp",))


def test_third_party_component_end_to_end(stamp_plugin):
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

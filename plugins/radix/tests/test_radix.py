"""Radix-specific behaviour: splits, pages, policies, events, locks, errors."""

import itertools

import pytest
import torch

import kvcore
from kvcore import RadixKey
from kvcore.testing import admit, check_invariants, finish, make_req, prefill
from kvcore.tree.events import AllPagesCleared, PageRemoved, PageStored, page_hash
from kvcore_radix import RadixCache, RadixConfig


def build(**opts):
    opts.setdefault("size", 256)
    opts.setdefault("max_num_reqs", 4)
    opts.setdefault("max_context_len", 128)
    cache = kvcore.create_cache("radix", **opts)
    cache.clock = itertools.count().__next__  # deterministic, strictly increasing
    return cache


def put(cache, ids, extra=None, **kw):
    """Insert with fresh slots; free what the tree did not keep."""
    ps = cache.page_size
    n = len(ids)
    slots = cache.token_to_kv_pool_allocator.alloc(-(-n // ps) * ps)
    res = cache.insert(RadixKey(ids, extra), slots[:n], **kw)
    aligned = n - n % ps
    drop = [d for d in (slots[: res.prefix_len], slots[aligned:]) if d.numel()]
    if drop:
        cache.token_to_kv_pool_allocator.free(torch.cat(drop))
    return res, slots[:aligned]


def test_backend_registered():
    spec = kvcore.available_backends()["radix"]
    assert spec.distribution == "kvcore-radix"
    assert spec.config is RadixConfig
    assert isinstance(build(), RadixCache)
    assert set(kvcore.available_eviction_policies()) >= {"lru", "lfu", "fifo", "mru", "filo", "priority", "slru"}


def test_split_on_match_keeps_slots():
    cache = build()
    _, slots = put(cache, [1, 2, 3, 4, 5, 6])
    m = cache.match_prefix([1, 2, 3, 9])
    assert m.device_indices.tolist() == slots[:3].tolist()
    assert m.last_device_node is m.best_match_node
    assert m.last_device_node.key == [1, 2, 3] if isinstance(m.last_device_node.key, list) else True
    assert len(m.last_device_node.children) == 1
    assert cache.total_size() == 6 and cache.evictable_size() == 6
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 7]).device_indices.tolist() == slots.tolist()
    check_invariants(cache)


def test_insert_prefix_len_and_branching():
    cache = build()
    res, _ = put(cache, [1, 2, 3])
    assert res.prefix_len == 0
    res, _ = put(cache, [1, 2, 4, 5])
    assert res.prefix_len == 2
    res, _ = put(cache, [1, 2, 4, 5, 6, 7])
    assert res.prefix_len == 4
    res, _ = put(cache, [8, 9])
    assert res.prefix_len == 0
    assert cache.total_size() == 3 + 2 + 2 + 2
    assert cache.match_prefix([1, 2, 4, 5, 6]).device_indices.numel() == 5
    check_invariants(cache)


def test_value_none_uses_token_ids():
    cache = build(size=64)
    res = cache.insert([5, 6, 7])
    assert res.prefix_len == 0
    assert cache.match_prefix([5, 6, 7]).device_indices.tolist() == [5, 6, 7]


def test_split_keeps_lock_on_both_halves():
    cache = build()
    put(cache, [1, 2, 3, 4, 5, 6])
    node = cache.match_prefix([1, 2, 3, 4, 5, 6]).last_device_node
    lock = cache.inc_lock_ref(node)
    assert lock.delta == 6 and cache.protected_size() == 6 and cache.evictable_size() == 0
    upper = cache.match_prefix([1, 2, 3]).last_device_node
    assert upper is not node and upper.lock_ref == 1 and node.lock_ref == 1
    assert cache.protected_size() == 6
    assert cache.dec_lock_ref(node, lock).delta == -6
    assert cache.evictable_size() == 6 and cache.protected_size() == 0
    check_invariants(cache)


def test_page_alignment():
    cache = build(page_size=4, size=256)
    res, slots = put(cache, list(range(1, 11)))  # 10 tokens: 8 cached
    assert res.prefix_len == 0 and cache.total_size() == 8
    assert cache.match_prefix(list(range(1, 8))).device_indices.numel() == 4
    assert cache.match_prefix(list(range(1, 11))).device_indices.tolist() == slots.tolist()
    # A match diverging inside a page stops at the page boundary and splits there.
    m = cache.match_prefix([1, 2, 3, 4, 5, 6, 0, 0])
    assert m.device_indices.numel() == 4
    assert len(m.last_device_node.key) == 4
    res, _ = put(cache, [1, 2, 3, 4, 5, 6, 0, 0, 9])
    assert res.prefix_len == 4
    assert cache.match_prefix([1, 2, 3]).device_indices.numel() == 0
    check_invariants(cache)


def test_extra_key_namespaces():
    cache = build()
    put(cache, [1, 2, 3], extra="a")
    assert cache.match_prefix([1, 2, 3]).device_indices.numel() == 0
    assert cache.match_prefix(RadixKey([1, 2, 3], "b")).device_indices.numel() == 0
    assert cache.match_prefix(RadixKey([1, 2], "a")).device_indices.numel() == 2
    res, _ = put(cache, [1, 2, 3])
    assert res.prefix_len == 0
    assert cache.total_size() == 6
    check_invariants(cache)


def _three_leaves(policy, **kw):
    cache = build(eviction_policy=policy, **kw)
    put(cache, [1, 1, 1])  # t0
    put(cache, [2, 2, 2], priority=5)
    put(cache, [3, 3, 3], priority=1)
    return cache


def _survivors(cache):
    return [k for k in (1, 2, 3) if cache.match_prefix([k, k, k]).device_indices.numel() == 3]


@pytest.mark.parametrize(
    "policy, touch, first_evicted",
    [
        ("lru", [1], 2),  # 1 refreshed: 2 is the least recently used
        ("mru", [1], 1),
        ("fifo", [1], 1),  # creation order, access does not matter
        ("filo", [1], 3),
        ("lfu", [1, 1, 2], 3),  # 3 was hit least
        ("priority", [1], 1),  # priority 0 < 1 < 5
        ("slru", [2, 2], 1),  # hit counts >= 2 are protected; 1 is older than 3
    ],
)
def test_policy_order(policy, touch, first_evicted):
    cache = _three_leaves(policy)
    for k in touch:
        if policy in ("lfu", "slru"):
            put(cache, [k, k, k])  # an insert counts a hit
        else:
            cache.match_prefix([k, k, k])
    assert cache.evict(1).num_tokens_evicted == 3
    remaining = {1, 2, 3} - {first_evicted}
    # match_prefix refreshes access times, so read survivors only at the end.
    assert set(_survivors(cache)) == remaining
    check_invariants(cache)


def test_evict_parents_become_candidates():
    cache = build()
    put(cache, [1, 2, 3, 4])
    put(cache, [1, 2, 5, 6])
    assert cache.total_size() == 6
    assert cache.evict(100).num_tokens_evicted == 6
    assert cache.total_size() == 0
    assert cache.token_to_kv_pool_allocator.available_size() == 256
    check_invariants(cache)


def test_unknown_policy_lists_known():
    with pytest.raises(ValueError, match="lru"):
        kvcore.create_cache("radix", size=64, eviction_policy="nope")


def test_third_party_policy_through_core_registry(monkeypatch):
    import kvcore.plugins

    class Newest:
        def get_priority(self, node):
            return -node.id

    real = kvcore.plugins.get_eviction_policy
    monkeypatch.setattr(kvcore.plugins, "get_eviction_policy", lambda name: Newest if name == "newest" else real(name))
    cache = build(eviction_policy="newest")
    put(cache, [1, 1])
    put(cache, [2, 2])
    cache.evict(1)
    assert _survivors_two(cache) == [1]


def _survivors_two(cache):
    return [k for k in (1, 2) if cache.match_prefix([k, k]).device_indices.numel() == 2]


def test_kv_events_hash_chain():
    cache = build(page_size=2, enable_kv_events=True)
    put(cache, [1, 2, 3, 4])
    ev = cache.take_events()
    assert [type(e) for e in ev] == [PageStored, PageStored]
    assert ev[0].parent_hash is None and ev[1].parent_hash == ev[0].page_hash
    assert ev[0].page_hash == page_hash([1, 2], None, None)
    assert ev[1].page_hash == page_hash([3, 4], ev[0].page_hash, None)
    assert ev[0].token_ids == (1, 2)
    assert cache.take_events() == []
    # Extending a cached prefix chains on its last page, through a split.
    put(cache, [1, 2, 7, 8])
    (e,) = cache.take_events()
    assert e.parent_hash == ev[0].page_hash
    # Another namespace hashes differently.
    put(cache, [1, 2], extra="lora")
    (x,) = cache.take_events()
    assert x.page_hash != ev[0].page_hash and x.extra_key == "lora"
    cache.evict(100)
    removed = cache.take_events()
    assert all(isinstance(r, PageRemoved) for r in removed)
    assert {r.page_hash for r in removed} == {ev[0].page_hash, ev[1].page_hash, e.page_hash, x.page_hash}
    cache.reset()
    assert cache.take_events() == [AllPagesCleared()]


def test_kv_events_off_by_default():
    cache = build()
    put(cache, [1, 2, 3])
    cache.evict(10)
    assert cache.take_events() == []


def test_dec_lock_ref_on_unlocked_node_raises_and_changes_nothing():
    cache = build()
    put(cache, [1, 2, 3, 4])
    node = cache.match_prefix([1, 2, 3, 4]).last_device_node
    with pytest.raises(ValueError, match=f"UnifiedNode {node.id} "):
        cache.dec_lock_ref(node)
    assert cache.evictable_size() == 4 and cache.protected_size() == 0
    # Locked leaf but unlocked parent path after a split: refused as a whole.
    lock = cache.inc_lock_ref(node)
    cache.dec_lock_ref(node, lock)
    with pytest.raises(ValueError):
        cache.dec_lock_ref(node, lock)
    assert node.lock_ref == 0 and cache.evictable_size() == 4
    check_invariants(cache)


def test_lock_errors():
    cache = build()
    other = build()
    put(other, [1, 2])
    foreign = other.match_prefix([1, 2]).last_device_node
    with pytest.raises(ValueError, match="not in this cache"):
        cache.inc_lock_ref(foreign)
    with pytest.raises(TypeError):
        cache.inc_lock_ref(None)
    put(cache, [5, 6])
    node = cache.match_prefix([5, 6]).last_device_node
    cache.evict(10)
    with pytest.raises(ValueError):
        cache.inc_lock_ref(node)  # evicted
    assert cache.inc_lock_ref(cache.root_node).delta == 0


def test_insert_errors_leave_tree_unchanged():
    cache = build()
    put(cache, [1, 2, 3, 4])
    before = (cache.total_size(), cache.evictable_size(), len(cache.root_node.children))
    with pytest.raises(ValueError):
        cache.insert([1, 2, 9], torch.tensor([1, 2], dtype=torch.int64))
    with pytest.raises(TypeError):
        cache.insert([1, 2, 9], torch.tensor([1.0, 2.0, 3.0]))
    with pytest.raises(TypeError):
        cache.insert([1, 2, 9], [1, 2, 3])
    with pytest.raises(ValueError):
        cache.insert([1, 2, -9], torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError):
        cache.match_prefix([1, 2, -9])
    # A bad id after a cached prefix must not even split the node it diverges in.
    with pytest.raises(TypeError):
        cache.match_prefix([1, 2, "x"])
    assert (cache.total_size(), cache.evictable_size(), len(cache.root_node.children)) == before
    assert len(next(iter(cache.root_node.children.values())).key) == 4


def test_reset_refused_while_locked():
    cache = build()
    put(cache, [1, 2])
    node = cache.match_prefix([1, 2]).last_device_node
    lock = cache.inc_lock_ref(node)
    with pytest.raises(RuntimeError):
        cache.reset()
    cache.dec_lock_ref(node, lock)
    cache.reset()
    assert cache.token_to_kv_pool_allocator.available_size() == 256
    check_invariants(cache)


def test_disable():
    cache = build(disable=True)
    slots = cache.token_to_kv_pool_allocator.alloc(3)
    assert cache.insert([1, 2, 3], slots).prefix_len == 0
    cache.token_to_kv_pool_allocator.free(slots)
    assert cache.match_prefix([1, 2, 3]).device_indices.numel() == 0
    req = make_req("r", [1, 2, 3, 4])
    assert admit(cache, req) and prefill(cache, req)
    finish(cache, req)
    assert cache.total_size() == 0
    assert cache.token_to_kv_pool_allocator.available_size() == 256
    check_invariants(cache)


def test_iter_owned_slots_covers_tree():
    cache = build()
    put(cache, [1, 2, 3])
    put(cache, [1, 2, 4])
    owners = list(cache.iter_owned_slots())
    assert all(o.pool == "full" and o.owner.startswith("radix node ") for o in owners)
    assert sum(o.slots.numel() for o in owners) == cache.total_size() == 4


def test_unfinished_req_adopts_tree_slots():
    """Two requests prefill the same prompt; the second's chunk finds the first's KV."""
    cache = build()
    prompt = list(range(10, 30))
    a, b = make_req("a", prompt), make_req("b", prompt)
    assert admit(cache, a) and admit(cache, b)
    assert prefill(cache, a, 12) and prefill(cache, b, 12)
    r2t = cache.req_to_token_pool.req_to_token
    assert r2t[a.kv.req_pool_idx, :12].tolist() == r2t[b.kv.req_pool_idx, :12].tolist()
    assert b.kv.cache_protected_len == 12
    assert b.prefix_indices.tolist() == r2t[a.kv.req_pool_idx, :12].tolist()
    assert cache.protected_size() == 12  # both lock the same nodes once each
    check_invariants(cache, [a, b])
    prefill(cache, a)
    prefill(cache, b)
    finish(cache, a)
    finish(cache, b)
    assert cache.protected_size() == 0 and cache.evictable_size() == 20
    check_invariants(cache)


def test_unfinished_req_paged_keeps_partial_page():
    cache = build(page_size=4, size=256)
    req = make_req("p", list(range(1, 20)))
    assert admit(cache, req)
    assert prefill(cache, req, 10)
    assert req.kv.cache_protected_len == 8
    assert req.prefix_indices.numel() == 10
    assert cache.total_size() == 8
    check_invariants(cache, [req])
    prefill(cache, req)
    finish(cache, req)
    assert cache.total_size() == 16
    check_invariants(cache)

"""The ``swa`` component set of the one tree: an eviction gives its slots back in one call per kind,
and a request's finish is checked before anything changes.

An eviction walks the LRU orders first and frees afterwards (live leaves: both pools;
stateless leaves: the full pool; nodes tombstoned by the window phase: the window pool).
A new leaf longer than the window is cut at one window below its end (SGLang's unified
tree), so with a window of 4 an 8-token insert is two 4-token nodes.
These tests pin what the pools hold afterwards, the counts ``evict`` reports and the
ownership records, so that batching can never leak or double-free a slot.
"""

import pytest
import torch

from kvcore import InvariantChecker, Req, create_cache
from kvcore.testing.swa import SWAEngine


def make(**kw):
    opts = dict(size=256, swa_size=128, sliding_window_size=4, page_size=1, max_num_reqs=4, max_context_len=128)
    opts.update(kw)
    return create_cache("swa", **opts)


def check(cache, owners=()):
    InvariantChecker(cache).check(owners=list(owners))
    cache.sanity_check()


def insert(cache, key, swa_evicted_seqlen=0):
    alloc = cache.token_to_kv_pool_allocator
    ps = cache.page_size
    n = len(key) // ps * ps
    slots = alloc.alloc(n) if ps == 1 else alloc.alloc_extend([0], [0], [n], [n], [-1], n)
    return cache.insert(key, slots, 0, swa_evicted_seqlen)


def assert_pools_empty(cache):
    a = cache.token_to_kv_pool_allocator
    assert a.full_available_size() == a.size_full
    assert a.swa_available_size() == a.size_swa
    assert a.claimed_slots().numel() == 0
    assert cache.total_size() == 0 and cache.swa_total_size() == 0


@pytest.mark.parametrize("ps", [1, 4])
def test_full_eviction_frees_live_leaves_and_tombstones_together(ps):
    cache = make(page_size=ps)
    # Three branches: one with a tombstone above its live leaf, two live.
    insert(cache, list(range(100, 116)), swa_evicted_seqlen=8)
    insert(cache, list(range(200, 216)))
    insert(cache, list(range(300, 308)))
    assert cache.total_size() == 40 and cache.swa_total_size() == 32
    check(cache)
    r = cache.evict(10**6, 0)
    assert (r.num_tokens_evicted, r.swa_num_tokens_evicted) == (40, 32)
    assert_pools_empty(cache)
    check(cache)


@pytest.mark.parametrize("ps", [1, 4])
def test_partial_full_eviction_frees_exactly_the_evicted_nodes(ps):
    cache = make(page_size=ps)
    insert(cache, list(range(100, 108)))
    insert(cache, list(range(200, 208)))
    insert(cache, list(range(300, 308)))
    a = cache.token_to_kv_pool_allocator
    full, swa = a.full_available_size(), a.swa_available_size()
    r = cache.evict(12, 0)  # three 4-token nodes: the oldest branch whole, the lower half of the next
    assert (r.num_tokens_evicted, r.swa_num_tokens_evicted) == (12, 12)
    assert a.full_available_size() == full + 12 and a.swa_available_size() == swa + 12
    assert cache.match_prefix(list(range(300, 308))).device_indices.numel() == 8
    assert cache.match_prefix(list(range(200, 208))).device_indices.numel() == 4
    assert cache.match_prefix(list(range(100, 108))).device_indices.numel() == 0
    check(cache)


def test_window_eviction_tombstones_internal_nodes_and_deletes_leaves_in_one_walk():
    cache = make()
    insert(cache, list(range(8)))
    insert(cache, list(range(16)))  # [0, 8) is now internal, [8, 16) its leaf
    a = cache.token_to_kv_pool_allocator
    full, swa = a.full_available_size(), a.swa_available_size()
    # Oldest first in the window order: the internal nodes are tombstoned (window side only);
    # the leaf goes whole (both sides).  What stays is stateless (full slots only) until full
    # eviction asks for it.
    r = cache.evict(0, 16)
    assert (r.num_tokens_evicted, r.swa_num_tokens_evicted) == (4, 16)
    assert a.full_available_size() == full + 4 and a.swa_available_size() == swa + 16
    assert cache.total_size() == 12 and cache.swa_total_size() == 0
    check(cache)
    r = cache.evict(10**6, 0)
    assert (r.num_tokens_evicted, r.swa_num_tokens_evicted) == (12, 0)
    assert_pools_empty(cache)
    check(cache)


def test_window_eviction_of_a_locked_leaf_keeps_its_full_slots():
    cache = make()
    insert(cache, list(range(8)))
    insert(cache, list(range(16)))
    node = cache.match_prefix(list(range(16))).last_device_node
    lock = cache.inc_lock_ref(node)
    a = cache.token_to_kv_pool_allocator
    full, swa = a.full_available_size(), a.swa_available_size()
    # The window lock covers one window, the 4-token leaf: the three nodes above can lose their
    # window side, the locked leaf cannot.
    r = cache.evict(0, 16)
    assert (r.num_tokens_evicted, r.swa_num_tokens_evicted) == (0, 12)
    assert a.full_available_size() == full and a.swa_available_size() == swa + 12
    check(cache)
    cache.dec_lock_ref(node, lock)
    r = cache.evict(10**6, 10**6)
    assert r.num_tokens_evicted == 16
    assert_pools_empty(cache)
    check(cache)


def test_finish_with_too_few_token_ids_changes_nothing():
    """The key is read before the window settles: a bad record frees no window slot."""
    cache = make(size=1024, swa_size=256)
    eng = SWAEngine(cache)
    r = eng.admit(Req("f", list(range(20))))
    r.kv.swa_evict_floor = 20
    eng.prefill(r)
    for t in range(30):
        eng.decode(r, t)
    r.output_ids = r.output_ids[:5]  # 25 ids, 50 committed
    a = cache.token_to_kv_pool_allocator
    before = (a.full_available_size(), a.swa_available_size(), cache.total_size(), cache.swa_total_size())
    mapping = a.full_to_swa_index_mapping.clone()
    with pytest.raises(ValueError, match="kv_committed_len"):
        cache.cache_finished_req(r)
    assert (a.full_available_size(), a.swa_available_size(), cache.total_size(), cache.swa_total_size()) == before
    assert torch.equal(a.full_to_swa_index_mapping, mapping)
    r.output_ids = list(range(30))
    eng.finish(r)
    eng.check()
    cache.evict(10**6, 10**6)
    assert_pools_empty(cache)
    check(cache)


def test_finish_with_a_foreign_slot_changes_nothing():
    cache = make(size=1024, swa_size=256)
    eng = SWAEngine(cache)
    r = eng.admit(Req("f", list(range(20))))
    r.kv.swa_evict_floor = 20
    eng.prefill(r)
    for t in range(30):
        eng.decode(r, t)
    a = cache.token_to_kv_pool_allocator
    row = cache.req_to_token_pool.req_to_token[r.kv.req_pool_idx]
    saved = int(row[25])
    spare = a.alloc(1)
    a.free(spare)
    row[25] = int(spare[0])  # a free slot: may not enter the tree
    before = (a.full_available_size(), a.swa_available_size(), cache.total_size(), cache.swa_total_size())
    with pytest.raises(ValueError, match="free"):
        cache.cache_finished_req(r)
    assert (a.full_available_size(), a.swa_available_size(), cache.total_size(), cache.swa_total_size()) == before
    row[25] = saved
    eng.finish(r)
    eng.check()
    cache.evict(10**6, 10**6)
    assert_pools_empty(cache)
    check(cache)

"""Mamba scenarios: COW, tombstones, eviction order, locks, the request life cycle, bad input.

Every test ends with ``kvcore.InvariantChecker``, which counts the ``mamba`` pool too
(every state slot free once, or held by exactly one node, request or session).
"""

from __future__ import annotations

import pytest
import torch

import kvcore
from kvcore import ConfigError, Engine, RadixKey, StreamingSession, create_cache
from kvcore.testing import admit, check_invariants, decode, finish, make_req, prefill
from kvcore.testing.conformance import snapshot


def build(**kw):
    opts = dict(size=256, max_num_reqs=6, max_context_len=128, mamba_size=8, mamba_cache_chunk_size=4)
    opts.update(kw)
    return create_cache("mamba", **opts)


def put(cache, key, extra=None):
    """Insert ``key`` with fresh full slots and a fresh state; returns (result, state slot)."""
    v = cache.token_to_kv_pool_allocator.alloc(len(key))
    mv = cache.mamba_pool.alloc(1)
    res = cache.insert(RadixKey(key, extra), v, mamba_value=mv)
    if res.mamba_exist:
        cache.mamba_pool.free(mv)
    return res, int(mv[0])


def states(cache) -> int:
    return cache.mamba_evictable_size() + cache.mamba_protected_size()


def reports(cache, owners=()):
    return {r.pool: r for r in check_invariants(cache, owners)}


# ----------------------------------------------------------------------------- pools and config

def test_pools_by_name_include_the_state_pool():
    cache = build()
    assert [v.name for v in cache.pools()] == ["full", "mamba"]
    put(cache, [1, 2, 3])
    rep = reports(cache)
    assert rep["mamba"].total == 8 and rep["mamba"].evictable == 1 and rep["mamba"].available == 7
    assert cache.cached_sizes() == {"full": (3, 0), "mamba": (1, 0)}
    conv, temporal = cache.mamba_pool.mamba_cache.conv, cache.mamba_pool.mamba_cache.temporal
    assert conv[0].shape == (2, 9, 6, 3) and temporal.shape == (2, 9, 2, 4, 4)
    cache.sanity_check()


@pytest.mark.parametrize("bad", [dict(page_size=4, size=256, max_context_len=128, mamba_cache_chunk_size=6),
                                 dict(mamba_size=0),
                                 dict(eviction_policy="lfu"), dict(mamba_cache_chunk_size=0),
                                 dict(mamba_temporal_shape=(2, 0))])
def test_bad_options_are_refused(bad):
    with pytest.raises(ConfigError):
        build(**bad)


def test_pool_alloc_free_and_copy():
    pool = build().mamba_pool
    a = pool.alloc(2)
    assert a.dtype == torch.int64 and a.tolist() == [1, 2]
    assert pool.alloc(7) is None and pool.available_size() == 6
    pool.mamba_cache.temporal[:, a[0]] = 3.0
    pool.mamba_cache.conv[0][:, a[0]] = 2.0
    pool.copy_from(a[:1], a[1:])
    assert torch.equal(pool.mamba_cache.temporal[:, a[1]], pool.mamba_cache.temporal[:, a[0]])
    assert torch.equal(pool.mamba_cache.conv[0][:, a[1]], pool.mamba_cache.conv[0][:, a[0]])
    pool.free(a)
    for bad in (torch.tensor([0]), torch.tensor([9]), torch.tensor([1])):
        with pytest.raises(ValueError):
            pool.free(bad)  # padding, out of range, already free
    assert pool.available_size() == 8


# ----------------------------------------------------------------------------- match, COW, branching

def test_match_stops_at_the_last_state_and_reports_the_branching_point():
    cache = build()
    put(cache, list(range(1, 11)))                      # state at 10
    m = cache.match_prefix(list(range(1, 11)) + [50])
    assert m.prefix_len == 10 and m.mamba_branching_seqlen is None
    m = cache.match_prefix(list(range(1, 10)) + [50])   # splits at 9: a tombstone, no state there
    assert m.prefix_len == 0 and m.last_device_node is cache.root_node
    assert m.mamba_branching_seqlen == 8                # 9 matched tokens, floored to the chunk of 4
    put(cache, list(range(1, 6)))                       # heals nothing: a new split at 5 gets a state
    m = cache.match_prefix(list(range(1, 10)) + [50])
    assert m.prefix_len == 5 and m.mamba_branching_seqlen == 8
    cache.sanity_check()
    check_invariants(cache)


def test_cow_takes_a_slot_and_names_the_source():
    cache = build()
    _, src = put(cache, [1, 2, 3, 4])
    req = make_req("r", [1, 2, 3, 4, 5])
    m = cache.match_prefix([1, 2, 3, 4, 5], cow_mamba=True, req=req)
    comp = req.kv.components["mamba"]
    assert m.prefix_len == 4 and int(comp.mamba_cow_src_index) == src
    assert comp.mamba_pool_idx is not None and int(comp.mamba_pool_idx) != src
    assert cache.mamba_pool.available_size() == 6
    # A request that already holds a slot is refused, nothing changed.
    before = snapshot(cache)
    with pytest.raises(ValueError, match="already holds state slot"):
        cache.match_prefix([1, 2, 3, 4, 5], cow_mamba=True, req=req)
    assert snapshot(cache) == before
    cache.mamba_pool.free(comp.mamba_pool_idx.reshape(1))
    # Nothing matched: nothing taken.
    other = make_req("o", [9, 9])
    cache.match_prefix([9, 9], cow_mamba=True, req=other)
    assert not other.kv.components.get("mamba") or not other.kv.components["mamba"].holds_mamba
    check_invariants(cache)


def test_cow_evicts_the_lru_unlocked_state_never_the_matched_one():
    cache = build(mamba_size=3)
    put(cache, [1, 1])
    put(cache, [2, 2])
    put(cache, [3, 3])
    cache.match_prefix([2, 2])           # 1 is now the least recently used state, 2 the most
    cache.match_prefix([1, 1, 5])        # ... and now 1 is the most recent: 3 is the LRU
    req = make_req("r", [3, 3, 4])
    cache.match_prefix([3, 3, 4], cow_mamba=True, req=req)   # 3 is matched: evict the next LRU, 2
    assert cache.match_prefix([3, 3]).prefix_len == 2
    assert cache.match_prefix([2, 2]).prefix_len == 0
    assert cache.match_prefix([1, 1]).prefix_len == 2
    # The public match took a slot for a request that holds no row yet: give it back ourselves.
    cache.mamba_pool.free(req.kv.components["mamba"].mamba_pool_idx.reshape(1))
    check_invariants(cache)


def test_engine_admission_copies_the_matched_state():
    cache = build()
    eng = Engine(cache, cache_prompt=False)
    a = make_req("a", [1, 2, 3, 4, 5, 6])
    assert eng.admit(a) and eng.extend(a)
    slot_a = a.kv.components["mamba"].mamba_pool_idx
    cache.mamba_pool.mamba_cache.temporal[:, slot_a] = 7.0   # the "forward" wrote a state
    eng.finish(a)                                            # donated to the tree at length 6
    b = make_req("b", [1, 2, 3, 4, 5, 6, 8, 9])
    assert eng.admit(b)
    assert b.kv.cache_protected_len == 6
    slot_b = b.kv.components["mamba"].mamba_pool_idx
    assert int(slot_b) != int(slot_a)
    assert bool((cache.mamba_pool.mamba_cache.temporal[:, slot_b] == 7.0).all())
    assert cache.stats()["cow_copies"] == 1
    rep = reports(cache, [b])
    assert rep["mamba"].uncached == 1 and rep["mamba"].protected == 1
    eng.finish(b)
    check_invariants(cache)


# ----------------------------------------------------------------------------- tombstones and eviction

def test_mamba_eviction_tombstones_internal_nodes_and_deletes_leaves():
    cache = build()
    put(cache, [1, 2, 3, 4])          # becomes internal after the next insert
    put(cache, [1, 2, 3, 4, 5, 6])
    assert states(cache) == 2
    res = cache.evict(0, mamba_num=1)  # LRU state: the internal node [1..4]
    assert (res.num_tokens_evicted, res.mamba_num_evicted) == (0, 1)
    assert cache.full_evictable_size() == 6 and states(cache) == 1
    assert cache.match_prefix([1, 2, 3, 4, 9]).prefix_len == 0   # a tombstone now
    cache.sanity_check()
    res = cache.evict(0, mamba_num=1)  # the leaf goes whole (its full slots counted too)
    assert res.mamba_num_evicted == 1 and res.num_tokens_evicted == 2
    # The tombstone above it is a leaf now, with its full slots alone (stateless): it stays until full
    # eviction asks for it (SGLang's unified tree; its legacy MambaRadixCache deleted it at once).
    assert cache.total_size() == 4 and states(cache) == 0
    cache.sanity_check()
    res = cache.evict(1)
    assert (res.num_tokens_evicted, res.mamba_num_evicted) == (4, 0)
    assert cache.total_size() == 0
    assert cache.token_to_kv_pool_allocator.available_size() == 256
    check_invariants(cache)


def test_insert_heals_a_tombstone():
    cache = build()
    put(cache, [1, 2, 3, 4])
    put(cache, [1, 2, 3, 4, 5, 6])
    cache.evict(0, mamba_num=1)
    res, _ = put(cache, [1, 2, 3, 4])
    assert res.prefix_len == 4 and not res.mamba_exist
    assert cache.match_prefix([1, 2, 3, 4, 9]).prefix_len == 4
    res, _ = put(cache, [1, 2, 3, 4])
    assert res.mamba_exist
    cache.sanity_check()
    check_invariants(cache)


def test_full_eviction_is_leaf_lru_and_a_hit_refreshes_only_the_used_state():
    cache = build()
    put(cache, [1, 1, 1])
    put(cache, [2, 2, 2])
    put(cache, [3, 3, 3])
    cache.match_prefix([1, 1, 1])
    res = cache.evict(3)              # LRU leaf: [2, 2, 2], its state with it (counted)
    assert res.num_tokens_evicted == 3 and res.mamba_num_evicted == 1
    assert cache.match_prefix([2, 2, 2]).prefix_len == 0
    assert cache.match_prefix([1, 1, 1]).prefix_len == 3 and cache.match_prefix([3, 3, 3]).prefix_len == 3
    # A hit on a child refreshes the child's state only: the parent's state stays old.
    cache2 = build()
    put(cache2, [5, 5])
    put(cache2, [5, 5, 6, 6])
    put(cache2, [7, 7])
    cache2.match_prefix([5, 5, 6, 6])
    cache2.evict(0, mamba_num=1)      # [5, 5] is the oldest state although its child was just hit
    assert cache2.match_prefix([5, 5, 9]).prefix_len == 0
    assert cache2.match_prefix([5, 5, 6, 6]).prefix_len == 4
    check_invariants(cache)
    check_invariants(cache2)


def test_a_lock_holds_the_path_and_its_own_state_only():
    cache = build()
    put(cache, [1, 2])
    put(cache, [1, 2, 3, 4])
    node = cache.match_prefix([1, 2, 3, 4]).last_device_node
    lock = cache.inc_lock_ref(node)
    assert lock.delta == 4
    assert cache.full_protected_size() == 4 and cache.mamba_protected_size() == 1
    assert cache.mamba_evictable_size() == 1
    res = cache.evict(100, mamba_num=5)
    assert res.num_tokens_evicted == 0 and res.mamba_num_evicted == 1   # the parent's state only
    assert cache.match_prefix([1, 2, 3, 4]).prefix_len == 4
    assert cache.match_prefix([1, 2, 9]).prefix_len == 0
    check_invariants(cache)
    cache.dec_lock_ref(node, lock)
    with pytest.raises(ValueError):
        cache.dec_lock_ref(node, lock)   # released twice: refused
    cache.evict(100)
    assert cache.total_size() == 0
    check_invariants(cache)


# ----------------------------------------------------------------------------- where SGLang's legacy tree differed
# ``mamba`` gives SGLang's UnifiedRadixCache (full, mamba) answers; its legacy MambaRadixCache differed here
# (the README lists each difference).

def test_an_insert_that_finds_the_state_makes_it_the_most_recent():
    cache = build()
    put(cache, [1, 1])
    put(cache, [2, 2])
    res, _ = put(cache, [1, 1])        # the state is there: refreshed (the legacy tree left its state LRU alone)
    assert res.mamba_exist and res.prefix_len == 2
    res = cache.evict(0, mamba_num=1)  # so [2, 2] is the least recently used state now
    assert (res.num_tokens_evicted, res.mamba_num_evicted) == (2, 1)
    assert cache.match_prefix([1, 1, 9]).prefix_len == 2
    assert cache.match_prefix([2, 2, 9]).prefix_len == 0
    check_invariants(cache)


@pytest.mark.parametrize("split_by", ["match", "insert"])
def test_a_split_makes_the_lower_part_s_state_the_most_recent(split_by):
    cache = build()
    put(cache, [1, 2, 3, 4])
    put(cache, [5, 5])
    if split_by == "match":
        assert cache.match_prefix([1, 2, 9]).prefix_len == 0   # splits [1, 2, 3, 4] at 2: no state on [1, 2]
    else:
        put(cache, [1, 2, 7])                                  # splits it at 2 and adds [7] below
    # The split re-queued [3, 4] (with its state) as the most recent: [5, 5] is the LRU state now
    # (the legacy tree kept the state's place and evicted [1, 2, 3, 4]).
    res = cache.evict(0, mamba_num=1)
    assert (res.num_tokens_evicted, res.mamba_num_evicted) == (2, 1)
    assert cache.match_prefix([5, 5, 9]).prefix_len == 0
    assert cache.match_prefix([1, 2, 3, 4, 9]).prefix_len == 4
    cache.sanity_check()
    check_invariants(cache)


def test_the_branching_point_lies_past_the_matched_state():
    cache = build()                                   # mamba_cache_chunk_size=4
    put(cache, list(range(1, 7)))
    put(cache, list(range(1, 11)))
    assert cache.evict(0, mamba_num=1).mamba_num_evicted == 1   # [1..6] becomes a tombstone
    put(cache, list(range(1, 6)))                     # splits it: [1..5] with a state, [6] a tombstone
    m = cache.match_prefix(list(range(1, 7)) + [99])
    # 6 tokens of full KV matched, floored to the chunk: 4, not past the state at 5: no branching point
    # (the legacy tree answered 4, a point its state at 5 already covers).
    assert m.prefix_len == 5 and m.mamba_branching_seqlen is None
    m = cache.match_prefix(list(range(1, 10)) + [99])
    assert m.prefix_len == 5 and m.mamba_branching_seqlen == 8
    cache.sanity_check()
    check_invariants(cache)


# ----------------------------------------------------------------------------- bad input

def test_bad_input_is_refused_with_nothing_changed():
    cache = build()
    put(cache, [1, 2, 3])
    alloc = cache.token_to_kv_pool_allocator
    before = snapshot(cache)
    held = cache.mamba_pool.alloc(1)
    v = alloc.alloc(3)
    snap = snapshot(cache)
    for mv in (torch.tensor([0]), torch.tensor([99]), torch.tensor([held.item() + 1]),   # padding, range, free
               torch.tensor([1])):                                                        # a node's state
        with pytest.raises(ValueError):
            cache.insert([4, 5, 6], v, mamba_value=mv)
        assert snapshot(cache) == snap
    with pytest.raises(ValueError):
        cache.insert([4, 5, 6], v, mamba_value=torch.tensor([held.item(), held.item()]))
    with pytest.raises(TypeError):
        cache.insert([4, 5, 6], v, mamba_value=torch.tensor([1.0]))
    with pytest.raises(ValueError):
        cache.insert([1, 2, 3, 4], torch.cat([cache.match_prefix([1, 2, 3]).device_indices, v[:1]]),
                     mamba_value=held)   # the cached part's slots are the tree's: not the caller's to free
    assert snapshot(cache) == snap
    # COW for a request that already holds a slot.
    req = make_req("r", [1, 2, 3, 4])
    assert admit(cache, req)
    snap = snapshot(cache)
    with pytest.raises(ValueError):
        cache.match_prefix([1, 2, 3, 4], cow_mamba=True, req=req)
    with pytest.raises(ValueError):
        cache.match_prefix([1, 2, 3], cow_mamba=True)   # no request
    assert snapshot(cache) == snap
    finish(cache, req)
    cache.mamba_pool.free(held)
    alloc.free(v)
    # A request that holds no state slot cannot be cached with one.
    ghost = make_req("g", [7, 7, 7])
    ghost.kv.req_pool_idx = None
    with pytest.raises(ValueError, match="holds no (state slot|req_to_token row)"):
        cache.cache_finished_req(ghost)
    assert snapshot(cache)[0:3] == before[0:3]
    check_invariants(cache)


# ----------------------------------------------------------------------------- the request life cycle

def test_finish_donates_the_state_and_chunks_snapshot_it():
    cache = build()
    req = make_req("r", list(range(10, 30)))
    assert admit(cache, req)
    slot = int(req.kv.components["mamba"].mamba_pool_idx)
    assert prefill(cache, req, 8)               # chunk: a copy of the state goes into the tree at 8
    assert states(cache) == 1 and cache.stats()["state_snapshots"] == 1
    assert req.kv.cache_protected_len == 8
    check_invariants(cache, [req])
    assert prefill(cache, req) and decode(cache, req, 2) == 2
    finish(cache, req)                          # the request's own slot goes to the tree at 22
    assert states(cache) == 2
    leaf = cache.match_prefix(req.fill_ids).last_device_node
    assert int(leaf.mamba_value[0]) == slot
    check_invariants(cache)


def test_retract_abort_and_drop_give_the_state_back():
    cache = build()
    eng = Engine(cache)
    reqs = [make_req(f"r{i}", [i, i, i, i, 5, 6]) for i in range(3)]
    for r in reqs:
        assert eng.admit(r)
    assert cache.mamba_pool.available_size() == 5
    check_invariants(cache, reqs)
    assert eng.extend(reqs[0], 3)
    eng.retract(reqs[0])                        # state back, record reset
    assert "mamba" not in reqs[0].kv.components
    eng.abort(reqs[1])
    eng.finish(reqs[2])                         # nothing allocated: dropped
    assert cache.mamba_pool.available_size() == 8 - states(cache)
    check_invariants(cache)
    assert eng.admit(reqs[0]) and eng.extend(reqs[0])
    eng.finish(reqs[0])
    check_invariants(cache)


def test_state_slots_run_short_at_admission():
    cache = build(mamba_size=2)
    eng = Engine(cache)
    a, b, c = (make_req(x, [ord(x)] * 5) for x in "abc")
    assert eng.admit(a) and eng.admit(b)
    assert not eng.admit(c)                     # both states held by running requests: refused
    assert not c.kv.is_held and "mamba" in c.kv.components and not c.kv.components["mamba"].holds_mamba
    check_invariants(cache, [a, b])
    eng.abort(a)
    assert eng.admit(c)
    check_invariants(cache, [b, c])
    for r in (b, c):
        eng.extend(r)
        eng.finish(r)
    # Two states in the tree, none free: a new request evicts the least recently used one.
    d = make_req("d", [9] * 5)
    assert eng.admit(d)
    assert states(cache) == 1
    check_invariants(cache, [d])
    eng.abort(d)
    check_invariants(cache)


def test_streaming_session_keeps_the_state_with_the_record():
    cache = StreamingSession(build())
    eng = Engine(cache)
    t1 = make_req("t1", [1, 2, 3, 4, 5], session_id="s")
    assert eng.admit(t1) and eng.extend(t1)
    eng.decode([t1], [6])
    eng.finish(t1)
    slot = cache.session_slots()[0]
    comp = slot.kv.components["mamba"]
    assert comp.holds_mamba
    rep = reports(cache)
    assert rep["mamba"].session_held == 1
    t2 = make_req("t2", t1.fill_ids + [7, 8], session_id="s")
    assert eng.admit(t2)
    assert t2.kv.components["mamba"] is comp     # the same record, the same state slot
    assert eng.extend(t2)
    eng.finish(t2)
    eng.end_session("s")
    assert cache.mamba_pool.available_size() == 8 - states(cache)
    check_invariants(cache)


def test_reset_returns_every_slot():
    cache = build()
    for i in range(5):
        put(cache, [i] * 4 + [i + 1] * (i + 1))
    cache.evict(0, mamba_num=2)
    cache.reset()
    assert cache.total_size() == 0 and cache.mamba_pool.available_size() == 8
    assert cache.token_to_kv_pool_allocator.available_size() == 256
    check_invariants(cache)


def test_kv_events_and_release_path():
    cache = build(enable_kv_events=True)
    req = make_req("r", [3, 4, 5, 6])
    assert admit(cache, req) and prefill(cache, req)
    kvcore.release_kv_cache(req, cache)
    assert len(cache.take_events()) == 4
    cache.evict(10)
    assert len(cache.take_events()) == 4
    check_invariants(cache)


# ----------------------------------------------------------------------------- page size 4 (extra-buffer mode)

def build4(**kw):
    opts = dict(size=256, max_num_reqs=4, max_context_len=128, mamba_size=16, mamba_cache_chunk_size=4,
                mamba_track_interval=8, page_size=4)
    opts.update(kw)
    return create_cache("mamba", **opts)


def test_page4_admission_takes_a_state_and_two_ping_pong_slots():
    cache = build4()
    req = make_req("r", list(range(10, 23)))               # 13 tokens
    assert admit(cache, req)
    comp = req.kv.components["mamba"]
    assert comp.holds_mamba and comp.mamba_ping_pong_track_buffer.tolist() == [2, 3]
    assert (comp.mamba_next_track_idx, comp.mamba_last_track_idx, comp.mamba_last_track_seqlen) == (0, 1, None)
    assert cache.mamba_pool.available_size() == 13
    assert reports(cache, [req])["mamba"].uncached == 3       # held by the request
    # A chunk of 6 tokens tracks a snapshot at 4 (one chunk), in ping-pong slot 0 (slot 2), which the
    # tree takes; the request gets a fresh slot in its place and the next snapshot goes to slot 1.
    assert prefill(cache, req, 6)
    assert req.kv.cache_protected_len == 4 and req.prefix_indices.numel() == 6
    assert comp.mamba_ping_pong_track_buffer.tolist() == [4, 3] and comp.mamba_next_track_idx == 1
    assert comp.mamba_last_track_seqlen is None
    node = cache.match_prefix(req.fill_ids[:4]).last_device_node
    assert node.mamba_value.tolist() == [2] and states(cache) == 1
    check_invariants(cache, [req])
    # The last chunk tracks at 6 + 4 = 10 (slot 3); decode 3 tokens: 16 is a decode boundary
    # (lcm(4, 8) = 8 -> 16), tracked in the other slot (4).  Finish caches [:16] with slot 4
    # and frees the request's own slot and slot 3.
    assert prefill(cache, req) and decode(cache, req, 3) == 3
    assert req.kv.kv_committed_len == 16
    finish(cache, req)
    assert states(cache) == 2
    leaf = cache.match_prefix(req.fill_ids).last_device_node
    assert leaf.mamba_value.tolist() == [4] and cache.match_prefix(req.fill_ids).prefix_len == 16
    assert cache.mamba_pool.available_size() == 14
    check_invariants(cache)


def test_page4_finish_without_a_snapshot_caches_nothing_and_frees_every_slot():
    cache = build4()
    req = make_req("r", [1, 2, 3])
    assert admit(cache, req) and prefill(cache, req) and decode(cache, req, 1) == 1
    finish(cache, req)                                       # 4 tokens, no decode boundary, no chunk
    assert states(cache) == 0 and cache.full_evictable_size() == 0
    assert cache.mamba_pool.available_size() == 16
    assert cache.token_to_kv_pool_allocator.available_size() == 256
    check_invariants(cache)


def test_page4_branching_point_is_snapshotted():
    cache = build4()
    eng = Engine(cache)
    a = make_req("a", list(range(1, 21)))
    assert eng.admit(a) and eng.extend(a)                    # cache_prompt: snapshot at 20
    eng.finish(a, is_insert=False)
    # b leaves a's path after 10 tokens: the match splits at 8 (page floor) and reports the
    # branching point 8; b's prefill snapshots there instead of at its own end.
    b = make_req("b", list(range(1, 11)) + [99] * 10)
    m = eng.match(b)
    assert m.result.mamba_branching_seqlen == 8 and m.prefix_len == 0
    assert eng.admit(b, matched=m) and eng.extend(b)
    assert b.kv.cache_protected_len == 8
    assert cache.match_prefix(list(range(1, 9))).prefix_len == 8
    eng.finish(b)
    check_invariants(cache)


def test_page4_streaming_session_moves_the_ping_pong_slots():
    cache = StreamingSession(build4())
    eng = Engine(cache)
    t1 = make_req("t1", list(range(1, 10)), session_id="s")
    assert eng.admit(t1) and eng.extend(t1)
    eng.decode([t1], [6])
    eng.finish(t1)
    slot = cache.session_slots()[0]
    comp = slot.kv.components["mamba"]
    buf = comp.mamba_ping_pong_track_buffer.tolist()
    assert comp.holds_mamba and len(buf) == 2
    assert reports(cache)["mamba"].session_held == 3
    t2 = make_req("t2", t1.fill_ids + [7, 8, 9, 10, 11], session_id="s")
    assert eng.admit(t2)
    assert t2.kv.components["mamba"] is comp                 # the same record, the same three slots
    assert eng.extend(t2)
    check_invariants(cache, [t2])
    eng.finish(t2)
    eng.end_session("s")
    assert cache.mamba_pool.available_size() == 16 - states(cache)
    check_invariants(cache)


def test_page4_retract_abort_give_every_slot_back():
    cache = build4(mamba_size=9)
    eng = Engine(cache)
    reqs = [make_req(f"r{i}", [i] * 4 + [5, 6, 7, 8, 9]) for i in range(3)]
    for r in reqs:
        assert eng.admit(r)
    assert cache.mamba_pool.available_size() == 0
    assert not eng.admit(make_req("x", [42] * 6))            # no state slot to be had: refused
    assert eng.extend(reqs[0], 4)
    eng.retract(reqs[0])
    eng.abort(reqs[1])
    eng.finish(reqs[2])
    assert cache.mamba_pool.available_size() == 9 - states(cache)
    check_invariants(cache)


def test_page4_bad_input():
    cache = build4()
    before = snapshot(cache)
    v = cache.token_to_kv_pool_allocator.alloc(8)
    mv = cache.mamba_pool.alloc(1)
    with pytest.raises(ValueError, match="page-aligned"):
        cache.insert(RadixKey(list(range(1, 7))), v[:6], mamba_value=mv)
    cache.mamba_pool.free(mv)
    cache.token_to_kv_pool_allocator.free(v)
    assert snapshot(cache) == before
    with pytest.raises(ConfigError, match="multiple of page_size"):
        build4(mamba_cache_chunk_size=6)
    req = make_req("r", [1, 2, 3, 4, 5])
    with pytest.raises(ValueError):
        cache.req_to_token_pool.free_mamba_cache(req.kv)   # holds nothing
    check_invariants(cache)

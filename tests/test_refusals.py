"""Bad input from an engine is refused with a clear error and changes nothing (reliability II).

Each test names the class of mistake it covers; every one failed on the code before
the fix (a leak, a use after free, an AssertionError from deep inside, or silent
acceptance) and ends with the invariant checker.
"""

from __future__ import annotations

import pytest
import torch

import kvcore
from kvcore import Engine, InvariantChecker
from kvcore.testing import make_req

WINDOWED = ["swa", "unified-swa", "swa-chunk", "swa-pure"]
TREES = ["radix", "swa", "mamba", "unified", "unified-swa", "unified-mamba", "npu", "swa-pure"]
EVERY = sorted(kvcore.available_backends())


def build(backend: str, **extra: object) -> kvcore.BasePrefixCache:
    fields = kvcore.available_backends()[backend].config.model_fields
    page = int(fields["page_size"].default or 1)
    size = 8192 if "device_buffer_size" in fields else 512  # hisparse: one request's device buffer fits
    options: dict[str, object] = {"size": size * page, "max_num_reqs": 8, "max_context_len": 64 * page}
    if "sliding_window_size" in fields:
        options["sliding_window_size"] = 2 * page
    if "swa_size" in fields:
        options["swa_size"] = 512 * page
    options.update(extra)
    return kvcore.create_cache(backend, **options)


def state(cache: kvcore.BasePrefixCache) -> tuple:
    return tuple((v.name, v.available()) for v in cache.pools()) + (
        cache.req_to_token_pool.available_size(), cache.evictable_size(), cache.protected_size())


def running(cache: kvcore.BasePrefixCache, rid: str = "r", n: int | None = None) -> tuple[Engine, kvcore.Req]:
    engine = Engine(cache)
    page = cache.page_size
    req = make_req(rid, list(range(10, 10 + (n or 4 * page + 1))))
    assert engine.admit(req)
    assert engine.extend(req)
    for _ in range(3 * page):
        assert engine.decode([req])
    return engine, req


# -- record fields trusted ----------------------------------------------------------------------

@pytest.mark.parametrize("backend", WINDOWED)
def test_window_cursor_past_committed_is_refused(backend: str) -> None:
    cache = build(backend)
    engine, req = running(cache)
    req.kv.swa_evicted_seqlen = req.kv.kv_committed_len + 5 * cache.page_size
    before = state(cache)
    with pytest.raises(ValueError, match="window cursor"):
        cache.free_window_slots([req])
    with pytest.raises(ValueError, match="window cursor"):
        engine.finish(req)
    assert state(cache) == before
    req.kv.swa_evicted_seqlen = 0
    engine.finish(req)
    InvariantChecker(cache).check(owners=[])


@pytest.mark.parametrize("backend", WINDOWED)
def test_float_window_floor_is_refused(backend: str) -> None:
    cache = build(backend)
    engine, req = running(cache)
    req.kv.swa_evict_floor = 2.5  # type: ignore[assignment]
    before, cursor = state(cache), req.kv.swa_evicted_seqlen
    with pytest.raises(TypeError, match="swa_evict_floor=2.5 is not an int"):
        cache.free_window_slots([req])
    assert state(cache) == before and req.kv.swa_evicted_seqlen == cursor
    req.kv.swa_evict_floor = 0
    engine.finish(req)
    InvariantChecker(cache).check(owners=[])


@pytest.mark.parametrize("backend", WINDOWED)
def test_pre_lens_must_match_the_batch(backend: str) -> None:
    cache = build(backend)
    engine, req = running(cache)
    before = state(cache)
    for pre_lens in ([], [1, 2], [req.kv.kv_allocated_len + 10]):
        with pytest.raises(ValueError, match="pre_len"):
            cache.free_window_slots([req], pre_lens)
    assert state(cache) == before
    engine.finish(req)
    InvariantChecker(cache).check(owners=[])


@pytest.mark.parametrize("backend", WINDOWED)
def test_window_free_of_another_caches_request_is_refused(backend: str) -> None:
    cache, other = build(backend), build(backend)
    engine, req = running(cache)
    cursor = req.kv.swa_evicted_seqlen
    with pytest.raises(ValueError, match="not one this cache's pool handed out"):
        other.free_window_slots([req])
    assert req.kv.swa_evicted_seqlen == cursor
    engine.finish(req)
    InvariantChecker(cache).check(owners=[])
    InvariantChecker(other).check(owners=[])


# -- calls in the wrong state ---------------------------------------------------------------------

@pytest.mark.parametrize("backend", EVERY)
def test_cache_finished_req_on_a_released_request(backend: str) -> None:
    cache = build(backend)
    engine, req = running(cache)
    engine.finish(req)
    before = state(cache)
    with pytest.raises(ValueError, match="holds no req_to_token row"):
        cache.cache_finished_req(req)
    assert state(cache) == before
    InvariantChecker(cache).check(owners=[])


@pytest.mark.parametrize("backend", ["radix", "mamba", "swa", "unified-swa", "chunk"])
def test_retract_of_a_request_that_is_not_running(backend: str) -> None:
    cache = build(backend)
    engine = Engine(cache)
    req = make_req("idle", [1, 2, 3])
    with pytest.raises(ValueError, match="is not running"):
        engine.retract(req)
    assert engine.retractions == 0 and req.retraction_count == 0
    InvariantChecker(cache).check(owners=[])


@pytest.mark.parametrize("backend", ["radix", "mamba", "swa", "unified-swa"])
def test_decode_batch_naming_a_request_twice(backend: str) -> None:
    cache = build(backend)
    engine, req = running(cache)
    before, length = state(cache), req.kv.kv_allocated_len
    with pytest.raises(ValueError, match="twice"):
        engine.decode([req, req])
    assert state(cache) == before and req.kv.kv_allocated_len == length
    engine.finish(req)
    InvariantChecker(cache).check(owners=[])


@pytest.mark.parametrize("backend", ["mamba", "unified-swa", "unified-mamba", "radix"])
@pytest.mark.parametrize("prompt", [[], [1, 1 << 63, 3]])
def test_admit_refuses_a_prompt_with_nothing_valid_to_compute(backend: str, prompt: list[int]) -> None:
    cache = build(backend)
    engine = Engine(cache)
    before = state(cache)
    with pytest.raises(ValueError, match="empty prompt|signed 64-bit"):
        engine.admit(make_req("bad", prompt))
    assert state(cache) == before
    InvariantChecker(cache).check(owners=[])


# -- a check skipped by an argument -----------------------------------------------------------------

@pytest.mark.parametrize("backend", ["swa", "mamba", "unified-swa", "unified-mamba"])
def test_prev_prefix_len_never_narrows_the_slot_check(backend: str) -> None:
    cache = build(backend)
    page = cache.page_size
    key = list(range(1, 1 + 4 * page))
    free_slots = torch.arange(1, 1 + 4 * page, dtype=torch.int64)  # never allocated: in the free lists
    before = state(cache)
    with pytest.raises(ValueError):
        cache.insert(key, free_slots, prev_prefix_len=len(key))
    assert state(cache) == before
    InvariantChecker(cache).check(owners=[])


# -- a lock given back twice: one rule ---------------------------------------------------------------

@pytest.mark.parametrize("backend", TREES)
def test_a_lock_given_back_twice_is_refused_the_same_way(backend: str) -> None:
    cache = build(backend)
    engine, req = running(cache)
    other = make_req("o", req.origin_input_ids[: 2 * cache.page_size + 1])
    assert engine.admit(other)
    assert other.last_node is not None and other.lock is not None
    cache.dec_lock_ref(other.last_node, other.lock)
    assert other.lock.released
    before = state(cache)
    with pytest.raises(ValueError, match="already given back"):
        cache.dec_lock_ref(other.last_node, other.lock)
    with pytest.raises(ValueError, match="already given back"):
        engine.finish(other)
    assert state(cache) == before
    other.lock = None
    other.last_node = None
    engine.abort(other)
    engine.finish(req)
    InvariantChecker(cache).check(owners=[])


# -- a slot or state owned twice -----------------------------------------------------------------

@pytest.mark.parametrize("backend", ["radix", "unified", "unified-swa", "unified-mamba", "mamba", "swa"])
def test_reinserting_a_cached_key_with_the_nodes_own_slots(backend: str) -> None:
    cache = build(backend)
    alloc = cache.token_to_kv_pool_allocator
    key = list(range(1, 1 + 4 * cache.page_size))
    cache.insert(key, alloc.alloc(len(key)))
    own = cache.match_prefix(key).device_indices.clone()
    before = state(cache)
    try:
        cache.insert(key, own)
    except ValueError as exc:
        assert "owned" in str(exc)
    # Accepted or refused, the node keeps its slots and none of them went back to the free list.
    assert state(cache) == before
    InvariantChecker(cache).check(owners=[])


def test_unified_mamba_refuses_a_state_another_node_owns() -> None:
    cache = build("unified-mamba")
    alloc = cache.token_to_kv_pool_allocator
    cache.insert([1, 2, 3, 4], alloc.alloc(4))
    match = cache.match_prefix([1, 2, 3, 4])
    node_state = match.last_device_node.mamba_value
    extra = alloc.alloc(2)
    before = state(cache)
    with pytest.raises(ValueError, match="already owned"):
        cache.insert([1, 2, 3, 4, 5, 6], torch.cat([match.device_indices, extra]),
                     mamba_value=node_state.reshape(1), prev_prefix_len=4)
    assert state(cache) == before
    alloc.free(extra)
    InvariantChecker(cache).check(owners=[])


def test_unified_mamba_cow_match_for_a_request_holding_a_state() -> None:
    cache = build("unified-mamba")
    engine, req = running(cache)
    held = req.kv.components["mamba"].mamba_pool_idx
    with pytest.raises(ValueError, match="already holds state slot"):
        cache.match_prefix(req.origin_input_ids, cow_mamba=True, req=req)
    assert req.kv.components["mamba"].mamba_pool_idx is held
    assert req.kv.components["mamba"].mamba_cow_src_index is None
    engine.finish(req)
    InvariantChecker(cache).check(owners=[])


# -- stale state reused ---------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["mamba", "unified-mamba"])
def test_a_diverging_session_turn_does_not_reuse_a_recurrent_state(backend: str) -> None:
    cache = build(backend)
    session = kvcore.StreamingSession(cache)
    engine = Engine(session)
    first = make_req("t1", list(range(10, 20)))
    first.session_id = "s"
    assert engine.admit(first) and engine.extend(first)
    engine.decode([first], [7])
    engine.finish(first)
    # The next turn rewrites the previous one from position 5 on.
    second = make_req("t2", list(range(10, 15)) + [99, 98, 97, 96])
    second.session_id = "s"
    assert engine.admit(second)
    # The session's record (and its state, which covers all 11 positions) was not reused.
    assert "s" not in session.slots
    assert second.kv.cache_protected_len <= 5
    assert engine.extend(second)
    engine.finish(second)
    engine.end_session("s")
    InvariantChecker(session).check(owners=[])


# -- allocator arguments trusted: a value that straddles pages ------------------------------------

@pytest.mark.parametrize(("backend", "page"), [("radix", 4), ("npu", 128), ("swa", 4), ("unified", 4), ("mamba", 4)])
def test_an_insert_whose_slots_straddle_pages_is_refused(backend: str, page: int) -> None:
    cache = build(backend, page_size=page, size=64 * page, max_context_len=8 * page)
    alloc = cache.token_to_kv_pool_allocator
    first, second = alloc.alloc(2 * page), alloc.alloc(page)
    straddling = torch.cat([first[page // 2:], second[: page // 2]])  # half of each of three pages
    before = state(cache)
    with pytest.raises(ValueError, match="whole pages"):
        cache.insert(list(range(1, 1 + 2 * page)), straddling)
    assert state(cache) == before
    alloc.free(first)
    alloc.free(second)
    InvariantChecker(cache).check(owners=[])

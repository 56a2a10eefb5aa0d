"""kvcore.engine.Engine: the one driver of the engine protocol, on every kind of backend.

Every test ends with the invariant checker.
"""

from __future__ import annotations

import pytest
import torch

import kvcore
from kvcore import Req, StreamingSession
from kvcore.engine import Engine

BACKENDS = ["radix", "swa", "chunk", "swa-chunk"]


def _build(backend: str, page: int, *, pages: int = 64, rows: int = 8, window_pages: int = 2, **extra):
    specs = kvcore.available_backends()
    if backend not in specs:
        pytest.skip(f"backend {backend!r} is not installed")
    fields = specs[backend].config.model_fields
    opts = dict(size=pages * page, page_size=page, max_num_reqs=rows, max_context_len=32 * page)
    if "sliding_window_size" in fields:
        opts["sliding_window_size"] = window_pages * page
    opts.update(extra)
    return kvcore.create_cache(backend, **opts)


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


@pytest.fixture(params=[1, 16], ids=lambda p: f"page{p}")
def page(request):
    return request.param


def toks(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def windowed(cache) -> bool:
    return any(v.windowed for v in cache.pools())


def state(cache, reqs=()) -> tuple:
    """Everything a refused call must leave as it was."""
    return (
        [(v.name, v.available()) for v in cache.pools()],
        cache.cached_sizes(),
        cache.req_to_token_pool.available_size(),
        [(r.kv.req_pool_idx, r.kv.cache_protected_len, r.kv.kv_committed_len, r.kv.kv_allocated_len,
          r.kv.swa_evicted_seqlen, len(r.output_ids)) for r in reqs],
    )


# ---------------------------------------------------------------------------- the happy path


def test_admit_extend_decode_finish(backend, page):
    cache = _build(backend, page)
    eng = Engine(cache)
    reuse = not cache.is_chunk_cache()
    system = toks(1000, 3 * page)
    a = Req("a", system + toks(1, page + 3))
    assert eng.admit(a)
    assert a.kv.is_held and a.kv.cache_protected_len == 0 and a.kv.kv_allocated_len == 0
    assert eng.extend(a, page + 1)  # a chunk
    assert a.kv.kv_committed_len == a.kv.kv_allocated_len == page + 1
    if reuse:
        assert a.kv.cache_protected_len == (page + 1) // page * page  # the chunked part is in the tree
    assert eng.extend(a)  # the last chunk: the prompt enters the tree (SGLang's scheduler)
    if reuse:
        assert a.kv.cache_protected_len == (len(a.origin_input_ids) // page) * page
    b = Req("b", system + toks(500, 2))
    assert eng.admit(b)
    assert b.kv.cache_protected_len == (len(system) if reuse else 0)
    assert torch.equal(
        cache.req_to_token_pool.req_to_token[b.kv.req_pool_idx, : b.kv.cache_protected_len].to(torch.int64),
        b.prefix_indices,
    )
    assert eng.extend(b)
    eng.check([a, b])
    for _ in range(3 * page):
        assert eng.decode([a, b], [7, 8]) == 2
    assert a.output_ids[-1] == 7 and b.output_ids[-1] == 8
    assert a.kv.kv_committed_len == a.kv.kv_allocated_len == a.seqlen
    if windowed(cache):
        assert a.kv.swa_evicted_seqlen > 0 and b.kv.swa_evicted_seqlen > 0
    eng.check([a, b])
    eng.finish(a)
    eng.finish(b)
    assert not a.kv.is_held and not b.kv.is_held
    assert cache.protected_size() == 0
    eng.check()


def test_cache_prompt_off_leaves_the_prompt_to_finish(page):
    cache = _build("radix", page)
    eng = Engine(cache, cache_prompt=False)
    r = Req("r", toks(0, 4 * page + 1))
    assert eng.admit(r) and eng.extend(r, 2 * page) and eng.extend(r)
    assert r.kv.cache_protected_len == 2 * page  # the chunk before the last one only
    eng.check([r])
    eng.finish(r)
    assert cache.evictable_size() == (4 * page + 1) // page * page
    eng.check()


def test_kv_writer_sees_every_slot(backend, page):
    cache = _build(backend, page)
    written: list[torch.Tensor] = []
    eng = Engine(cache, kv_writer=written.append)
    r = Req("r", toks(0, 2 * page + 3))
    assert eng.admit(r) and eng.extend(r, page + 1) and eng.extend(r)
    eng.decode([r], [1])
    eng.decode([r], [2])
    got = torch.cat(written).to(torch.int64)
    row = cache.req_to_token_pool.req_to_token[r.kv.req_pool_idx, : r.kv.kv_allocated_len].to(torch.int64)
    assert torch.equal(got, row)
    eng.finish(r)
    eng.check()


def test_max_prefix_len_caps_the_match(page):
    cache = _build("radix", page)
    eng = Engine(cache)
    prompt = toks(0, 4 * page)
    first = Req("first", prompt + [1])
    assert eng.admit(first) and eng.extend(first)
    eng.finish(first)
    r = Req("r", prompt + [2])
    assert eng.admit(r, max_prefix_len=2 * page)
    assert r.kv.cache_protected_len == 2 * page
    eng.abort(r)
    r2 = Req("r2", prompt)
    assert eng.admit(r2)  # default: all but the last token, in whole pages
    assert r2.kv.cache_protected_len == 3 * page
    eng.finish(r2)
    eng.check()


def test_match_then_cancel_holds_nothing(page):
    cache = _build("radix", page)
    eng = Engine(cache)
    first = Req("first", toks(0, 3 * page) + [1])
    assert eng.admit(first) and eng.extend(first)
    eng.finish(first)
    before = state(cache)
    r = Req("r", toks(0, 3 * page) + [2])
    m = eng.match(r)
    assert m.prefix_len == 3 * page and not m.restored
    assert cache.protected_size() == 3 * page
    eng.cancel(m)
    assert state(cache) == before and not r.kv.is_held and r.lock is None
    m = eng.match(r)
    assert eng.admit(r, matched=m)
    assert r.kv.cache_protected_len == 3 * page
    with pytest.raises(ValueError):
        eng.match(r)  # it holds KV already
    eng.finish(r)
    eng.check()


# ---------------------------------------------------------------------------- failures change nothing


def test_rows_run_out(backend, page):
    cache = _build(backend, page, rows=2)
    eng = Engine(cache)
    a, b, c = (Req(n, toks(10 * i, page + 1)) for i, n in enumerate("abc"))
    assert eng.admit(a) and eng.admit(b)
    before = state(cache, [a, b])
    assert not eng.admit(c)
    assert not c.kv.is_held and c.lock is None and c.last_node is None
    assert state(cache, [a, b]) == before
    eng.check([a, b])
    eng.finish(a)  # nothing allocated: aborted, its row goes back
    assert eng.admit(c)
    eng.finish(b)
    eng.finish(c)
    eng.check()


def test_allocation_failure_changes_nothing(backend, page):
    # A window of 5 pages: a's window lock holds all of a's cached prompt, so nothing is evictable.
    cache = _build(backend, page, pages=8, window_pages=5)
    eng = Engine(cache)
    a = Req("a", toks(0, 5 * page))
    assert eng.admit(a) and eng.extend(a)
    b = Req("b", toks(1000, 4 * page))
    assert eng.admit(b)
    before = state(cache, [a, b])
    assert not eng.extend(b)  # 4 pages wanted, 3 free, nothing to evict (a is running)
    assert state(cache, [a, b]) == before
    assert eng.alloc_slots(4 * page) is None
    assert state(cache, [a, b]) == before
    assert eng.extend(b, 3 * page)  # what fits does
    eng.check([a, b])
    # Every slot is taken: a decode step that needs a new page for both fails as a whole.
    a_lens = a.kv.kv_allocated_len
    assert eng.decode([a, b], free_window=False) == 0
    assert a.kv.kv_allocated_len == a_lens and not a.output_ids
    eng.check([a, b])
    eng.retract(b)  # the scheduler's way out: give b's slots back
    assert eng.decode([a]) == 1
    eng.finish(a)
    eng.check()


def test_make_room_evicts_the_shortfall(page):
    cache = _build("radix", page, pages=8)
    eng = Engine(cache)
    seen = []
    eng.on_evict = seen.append
    old = Req("old", toks(0, 6 * page))
    assert eng.admit(old) and eng.extend(old)
    eng.finish(old)
    assert cache.evictable_size() == 6 * page
    r = Req("r", toks(5000, 4 * page))
    assert eng.admit(r) and eng.extend(r)  # 2 pages free: 2 more come from the tree
    assert len(seen) == 1 and eng.evict_calls == 1
    assert seen[0].num_tokens_evicted >= 2 * page  # whole nodes go
    assert cache.evictable_size() <= 4 * page
    free = cache.pools()[0].available()
    assert eng.fits(free) and not eng.fits(free + page)
    eng.finish(r)
    eng.check()


# ---------------------------------------------------------------------------- retract and abort


def test_retract_resets_the_record_and_keeps_the_floor(backend, page):
    cache = _build(backend, page)
    eng = Engine(cache)
    total = [(v.name, v.available()) for v in cache.pools()]
    r = Req("r", toks(0, 3 * page + 1))
    assert eng.admit(r) and eng.extend(r)
    r.kv.swa_evict_floor = 2 * page  # prefill-aware SWA: the prompt stays out of window eviction
    for _ in range(page):
        eng.decode([r])
    old_kv = r.kv
    eng.retract(r)
    # SGLang's reset_for_retract resets the released record in place.
    assert r.kv is old_kv and not r.kv.is_held and r.kv.is_released and r.retraction_count == 1
    assert (r.kv.cache_protected_len, r.kv.kv_committed_len, r.kv.swa_evict_floor) == (0, 0, 2 * page)
    assert r.lock is None and r.last_node is None and r.prefix_indices.numel() == 0
    assert len(r.output_ids) == page  # SGLang recomputes prompt and output
    assert cache.protected_size() == 0
    eng.check()
    # Recompute: admitted again, it finds its own prompt in the tree.
    assert eng.admit(r) and eng.extend(r)
    if not cache.is_chunk_cache():
        assert r.kv.cache_protected_len > 0
    eng.finish(r)
    cache.reset()
    assert [(v.name, v.available()) for v in cache.pools()] == total
    eng.check()


def test_abort_caches_nothing(backend, page):
    cache = _build(backend, page)
    eng = Engine(cache, cache_prompt=False)
    r = Req("r", toks(0, 4 * page + 2))
    assert eng.admit(r) and eng.extend(r)
    eng.decode([r])
    eng.abort(r)
    assert not r.kv.is_held
    assert cache.total_size() == 0 and cache.protected_size() == 0
    for v in cache.pools():
        assert v.available() == v.capacity
    eng.check()


# ---------------------------------------------------------------------------- sessions


def test_session_turns(backend, page):
    sessions = StreamingSession(_build(backend, page))
    eng = Engine(sessions)
    t1 = Req("t1", toks(0, 2 * page + 3), session_id="s")
    assert eng.admit(t1) and eng.extend(t1)
    eng.decode([t1], [5])
    eng.finish(t1)
    assert list(eng.idle_sessions) == ["s"] and eng.session_is_live("s")
    eng.check()
    t2 = Req("t2", t1.fill_ids + toks(900, page), session_id="s")
    assert eng.admit(t2)
    assert t2.kv is sessions.slots["s"].kv and t2.kv.kv_committed_len == len(t1.fill_ids)
    assert not eng.idle_sessions
    assert eng.extend(t2)
    eng.decode([t2], [6])
    eng.check([t2])
    eng.finish(t2)
    assert eng.end_session("s") > 0
    assert not eng.session_is_live("s") and eng.session_releases == 1
    eng.check()


def test_idle_sessions_go_when_rows_run_short(page):
    sessions = StreamingSession(_build("radix", page, rows=1))
    eng = Engine(sessions)
    t1 = Req("t1", toks(0, page + 2), session_id="s")
    assert eng.admit(t1) and eng.extend(t1)
    eng.finish(t1)  # the idle session keeps the only row
    other = Req("other", toks(500, page + 2))
    assert eng.admit(other)  # the engine released the idle session for it
    assert eng.session_releases == 1 and not eng.session_is_live("s")
    eng.finish(other)
    eng.check()
    strict = Engine(sessions, release_idle_sessions=False)
    t1 = Req("t1", toks(0, page + 2), session_id="s")
    assert strict.admit(t1) and strict.extend(t1)
    strict.finish(t1)
    assert not strict.admit(Req("other", toks(500, page + 2)))
    assert strict.release_idle_session()
    strict.check()


def test_abort_of_a_session_turn_ends_the_session(page):
    sessions = StreamingSession(_build("radix", page))
    eng = Engine(sessions)
    t1 = Req("t1", toks(0, page + 2), session_id="s")
    assert eng.admit(t1) and eng.extend(t1)
    eng.finish(t1)
    t2 = Req("t2", t1.fill_ids + [1, 2, 3], session_id="s")
    assert eng.admit(t2) and eng.extend(t2)
    eng.retract(t2)
    assert not eng.session_is_live("s") and not t2.kv.is_held
    assert sessions.protected_size() == 0
    eng.check()
    # A first turn aborted does not become a session.
    t1 = Req("t1b", toks(0, page + 2), session_id="s2")
    assert eng.admit(t1) and eng.extend(t1)
    eng.abort(t1)
    assert not sessions.slots
    eng.check()

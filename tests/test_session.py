"""Streaming sessions: a conversation's KV kept between turns, on one shared record."""

import pytest
import torch

from kvcore import InvariantChecker, Req, StreamingSession, create_cache, release_kv_cache
from kvcore.testing import extend_slots


def extend(cache, req, upto):
    """Allocate and commit positions [allocated, upto) of req's row."""
    if not req.kv.is_held:
        assert cache.req_to_token_pool.alloc([req]) is not None
    assert extend_slots(cache, req, upto)
    req.kv.kv_committed_len = upto


@pytest.fixture
def session():
    return StreamingSession(create_cache("chunk", size=128, max_num_reqs=4, max_context_len=64))


def first_turn(session):
    req = Req("t1", list(range(10)), session_id="s")
    m = session.match_prefix(req.fill_ids, req)
    assert m.prefix_len == 0
    extend(session, req, 10)
    req.output_ids += [100, 101, 102]
    extend(session, req, 13)
    release_kv_cache(req, session)
    return req


def test_first_turn_is_kept_by_the_slot(session):
    req = first_turn(session)
    assert not req.kv.is_held  # the record moved to the slot
    slot = session.slots["s"]
    assert slot.kv.is_held and slot.kv.kv_committed_len == 13
    (report,) = InvariantChecker(session).check([])
    assert report.session_held == 13 and report.available == 128 - 13
    assert session.session_held_tokens() == 13


def test_next_turn_shares_the_record_and_restoring_twice_is_harmless(session):
    t1 = first_turn(session)
    t2 = Req("t2", t1.fill_ids + [7, 8, 9], session_id="s")
    before = session.token_to_kv_pool_allocator.available_size()
    m1 = session.match_prefix(t2.fill_ids, t2)
    m2 = session.match_prefix(t2.fill_ids, t2)  # a scheduler retry
    assert m1.prefix_len == m2.prefix_len == 13
    assert torch.equal(m1.device_indices, m2.device_indices)
    assert t2.kv is session.slots["s"].kv
    assert session.token_to_kv_pool_allocator.available_size() == before
    extend(session, t2, 16)
    (report,) = InvariantChecker(session).check([t2])  # counted once, as the request's
    assert report.uncached == 16 and report.session_held == 0
    release_kv_cache(t2, session)
    assert session.slots["s"].kv.kv_committed_len == 16
    assert session.release_session("s") == 16
    InvariantChecker(session).check([t1, t2])
    assert session.token_to_kv_pool_allocator.available_size() == 128
    assert session.req_to_token_pool.available_size() == 4


def test_match_frees_the_tail_beyond_committed(session):
    first_turn(session)
    slot = session.slots["s"]
    extend_slot = Req("spec", [], session_id="s")
    slot.restore_to_req(extend_slot)
    extend(session, extend_slot, 16)
    slot.kv.kv_committed_len = 13  # three speculative slots never committed
    # The new turn continues the first turn's 13 tokens (range(10) + [100, 101, 102]).
    t2 = Req("t2", list(range(10)) + [100, 101, 102] + list(range(7)), session_id="s")
    free_before = session.token_to_kv_pool_allocator.available_size()
    assert session.match_prefix(t2.fill_ids, t2).prefix_len == 13
    assert session.token_to_kv_pool_allocator.available_size() - free_before == 3
    assert slot.kv.kv_allocated_len == 13
    InvariantChecker(session).check([t2])
    with pytest.raises(RuntimeError, match="running on the session"):
        session.release_session("s")  # t2 runs on the session's KV
    t2.detach_kv()  # t2 stops running on it (what Engine.abort does)
    session.release_session("s")
    InvariantChecker(session).check([t2])


def test_shorter_turn_than_the_protected_prefix_is_rejected_without_change(session):
    first_turn(session)
    slot = session.slots["s"]
    slot.kv.cache_protected_len = 8
    t2 = Req("t2", [1, 2, 3], session_id="s")
    with pytest.raises(ValueError, match="append-only"):
        session.match_prefix(t2.fill_ids, t2)
    assert not t2.kv.is_held and slot.kv.kv_allocated_len == 13
    slot.kv.cache_protected_len = 0
    session.release_session("s")
    InvariantChecker(session).check([])


def test_later_turn_must_run_on_the_slot_record(session):
    first_turn(session)
    stranger = Req("x", [1, 2], session_id="s")
    extend(session, stranger, 2)
    with pytest.raises(AssertionError, match="does not run on session"):
        release_kv_cache(stranger, session)


def test_requests_without_session_go_to_the_backend(session):
    req = Req("plain", [1, 2, 3])
    assert session.match_prefix(req.fill_ids, req).prefix_len == 0
    extend(session, req, 3)
    release_kv_cache(req, session)
    assert session.slots == {}
    InvariantChecker(session).check([req])


def test_release_unknown_session_frees_nothing(session):
    assert session.release_session("nope") == 0
    InvariantChecker(session).check([])


def test_reset_releases_every_session(session):
    first_turn(session)
    session.reset()
    assert session.slots == {}
    (report,) = InvariantChecker(session).check([])
    assert report.available == 128

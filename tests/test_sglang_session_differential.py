"""kvcore's StreamingSession against SGLang's own (``srt/session/streaming_session.py``), path by path.

Both sessions run over a recording stand-in for the inner cache (a req_to_token
table, row frees, unlocks, and every ``free_kv_row`` range), fed the same
records: the overshoot trim at finish, a later turn's save, the mid-request
abort of a later turn, the page-aligned (NPU) reuse rule and the held counts
must leave the same lengths and free the same row ranges.  The same paths on
real pools, through ``kvcore.Engine``, are in tests/test_lifecycle.py.  Needs
SGLang 0.5.19's source (``$KVCORE_SGLANG_SRC``); skipped otherwise.
"""

from __future__ import annotations

import random

import pytest
import torch

from kvcore import Req, ReqKvInfo, StreamingSession
from kvcore.engine import Engine
from kvcore.session import SessionSlot
from tools.sglang_loader import default_src

SRC = default_src()
pytestmark = pytest.mark.skipif(SRC is None, reason="SGLang source not found (set KVCORE_SGLANG_SRC)")

WIDTH = 64


@pytest.fixture(scope="module")
def sgs():
    from tools.sglang_session_shim import load_sglang_session

    return {npu: load_sglang_session(SRC, npu=npu) for npu in (False, True)}


class Rows:
    """A req_to_token table whose frees are recorded."""

    def __init__(self) -> None:
        self.req_to_token = torch.arange(8 * WIDTH, dtype=torch.int32).reshape(8, WIDTH) + 100
        self.freed: list[int] = []

    def free(self, owner) -> None:
        self.freed.append(owner.kv.req_pool_idx)
        owner.kv.req_pool_idx = None


class Inner:
    """The surface both sessions read of the cache under them; every effect is recorded."""

    hook = None
    kv_pool = None
    disable = False
    metrics_collector = None
    capabilities: frozenset = frozenset()

    def __init__(self, page: int, page_aligned: bool = False) -> None:
        self.page_size = page
        self.session_page_aligned = page_aligned
        self.req_to_token_pool = Rows()
        self.token_to_kv_pool_allocator = object()
        self.ranges: list[list[tuple[int, int]]] = []
        self.unlocked: list = []

    def free_kv_row(self, kv, ranges) -> None:
        nonempty = [(s, e) for s, e in ranges if e > s]
        if nonempty:  # SGLang may hand an empty range over where kvcore makes no call: both free nothing
            self.ranges.append(nonempty)

    def dec_lock_ref(self, node, params=None):
        self.unlocked.append(node)



class SgSession:
    def __init__(self, sid: str) -> None:
        self.session_id = sid
        self.streaming = True
        self.events: list[str] = []

    def abort_req(self) -> None:
        self.events.append("abort")

    def finish_req(self, req) -> None:
        self.events.append("finish")


class SgReq:
    """What SGLang's StreamingSession reads of a request."""

    def __init__(self, ss, rid, ids, out, kv, sid="s") -> None:
        self.rid = rid
        self.origin_input_ids = list(ids)
        self.output_ids = list(out)
        self.kv = kv
        self.session = SgSession(sid)
        self.finished_len = None
        self.finished_reason = None
        self.to_finish = None
        self.last_node = None
        self.swa_uuid_for_lock = None
        self.skip_lock_node_ids = {}
        self._kv_cls = ss.ReqKvInfo

    def detach_kv(self):
        kv, self.kv = self.kv, self._kv_cls()
        return kv


def _sg_session(ss, inner: Inner):
    session = ss.StreamingSession(inner)
    session.free_kv_row = lambda kv, ranges: inner.free_kv_row(kv, ranges)  # SGLang's goes to its allocator
    return session


def _records(ss, **fields):
    return ss.ReqKvInfo(**fields), ReqKvInfo(**fields)


def _lens(kv) -> tuple:
    return (kv.req_pool_idx, kv.cache_protected_len, kv.kv_committed_len, kv.kv_allocated_len, kv.swa_evicted_seqlen)


def _random_record(rng: random.Random, page: int):
    """(origin length, outputs, record fields) for a finishing turn, possibly overshooting."""
    n_in = rng.randint(2, 24)
    n_out = rng.randint(1, 16)
    allocated = n_in + n_out
    committed = rng.randint(max(1, allocated - 3), allocated)
    protected = (rng.randint(0, n_in) // page) * page
    cursor = 0
    if rng.random() < 0.4 and allocated - protected > page:
        cursor = (rng.randint(protected, allocated - 1) // page) * page
    fields = dict(req_pool_idx=rng.randint(1, 7), cache_protected_len=protected, kv_committed_len=committed,
                  kv_allocated_len=allocated, swa_evicted_seqlen=cursor)
    return n_in, n_out, fields


@pytest.mark.parametrize("page", [1, 4])
def test_trim_overshoot_matches(sgs, page):
    ss = sgs[False]
    rng = random.Random(page)
    for case in range(300):
        n_in, n_out, fields = _random_record(rng, page)
        finished = rng.randint(0, n_out)
        si, oi = Inner(page), Inner(page)
        skv, okv = _records(ss, **fields)
        ids, out = list(range(n_in)), list(range(500, 500 + n_out))
        sreq = SgReq(ss, "r", ids, out, skv)
        oreq = Req("r", ids, out, kv=okv, session_id="s")
        _sg_session(ss, si)._trim_overshoot(sreq, finished)
        StreamingSession(oi)._trim_overshoot(oreq, finished)
        where = f"case {case}: {fields} finished={finished}"
        assert _lens(okv) == _lens(skv), where
        assert oi.ranges == si.ranges, where
        assert oreq.output_ids == sreq.output_ids, where


def test_trim_overshoot_example(sgs):
    """The brief's example: origin 26, finished 12 -> target 38; slots 38..43 freed."""
    ss = sgs[False]
    fields = dict(req_pool_idx=1, cache_protected_len=16, kv_committed_len=44, kv_allocated_len=44)
    si, oi = Inner(1), Inner(1)
    skv, okv = _records(ss, **fields)
    sreq = SgReq(ss, "r", range(26), range(18), skv)
    oreq = Req("r", list(range(26)), list(range(18)), kv=okv, session_id="s")
    _sg_session(ss, si)._trim_overshoot(sreq, 12)
    StreamingSession(oi)._trim_overshoot(oreq, 12)
    assert si.ranges == oi.ranges == [[(38, 44)]]
    assert _lens(skv) == _lens(okv) == (1, 16, 38, 38, 0)


@pytest.mark.parametrize("page", [1, 4])
def test_finishing_a_later_turn_saves_the_same_record(sgs, page):
    ss = sgs[False]
    rng = random.Random(10 + page)
    for case in range(200):
        n_in, n_out, fields = _random_record(rng, page)
        finished = rng.choice([None, rng.randint(0, n_out)])
        si, oi = Inner(page), Inner(page)
        skv, okv = _records(ss, **fields)
        ssess, osess = _sg_session(ss, si), StreamingSession(oi)
        # The session already holds the record (a later turn runs on it).
        ssess.slots["s"] = ss.SessionSlot(kv=skv)
        osess.slots["s"] = SessionSlot("s", kv=okv)
        ids, out = list(range(n_in)), list(range(500, 500 + n_out))
        sreq, oreq = SgReq(ss, "r", ids, out, skv), Req("r", ids, out, kv=okv, session_id="s")
        sreq.finished_len = oreq.finished_len = finished
        assert ssess.try_cache_finished_req(sreq)
        osess.cache_finished_req(oreq)
        where = f"case {case}: {fields} finished={finished}"
        assert _lens(osess.slots["s"].kv) == _lens(ssess.slots["s"].kv), where
        assert oi.ranges == si.ranges, where
        assert sreq.session.events == ["finish"]
        assert not oreq.kv.is_held and not sreq.kv.holds_kv


@pytest.mark.parametrize("page", [1, 4])
def test_abort_of_a_later_turn_releases_the_session_alike(sgs, page):
    ss = sgs[False]
    rng = random.Random(20 + page)
    for case in range(100):
        n_in, n_out, fields = _random_record(rng, page)
        si, oi = Inner(page), Inner(page)
        skv, okv = _records(ss, **fields)
        ssess, osess = _sg_session(ss, si), StreamingSession(oi)
        ssess.slots["s"] = ss.SessionSlot(kv=skv, last_node="first-turn-node")
        osess.slots["s"] = SessionSlot("s", kv=okv, last_node="first-turn-node")
        ids, out = list(range(n_in)), list(range(500, 500 + n_out))
        sreq, oreq = SgReq(ss, "r", ids, out, skv), Req("r", ids, out, kv=okv, session_id="s")
        osess.slots["s"].turn = oreq
        sreq.finished_reason = ss.FINISH_ABORT("client gone")
        assert ssess.try_cache_finished_req(sreq)  # SGLang: the abort reaches the cache as a finish
        Engine(osess).abort(oreq)  # kvcore: the engine's abort
        where = f"case {case}: {fields}"
        assert "s" not in ssess.slots and "s" not in osess.slots, where
        assert oi.ranges == si.ranges, where
        assert oi.unlocked == si.unlocked == ["first-turn-node"], where
        assert oi.req_to_token_pool.freed == si.req_to_token_pool.freed == [fields["req_pool_idx"]], where
        assert sreq.session.events == ["abort"]


@pytest.mark.parametrize("page", [4, 8])
def test_page_aligned_reuse_matches_the_npu_rule(sgs, page):
    ss = sgs[True]
    rng = random.Random(30 + page)
    for case in range(200):
        n_in, n_out, fields = _random_record(rng, page)
        fields["swa_evicted_seqlen"] = 0
        fields["kv_committed_len"] = fields["kv_allocated_len"]
        si, oi = Inner(page), Inner(page, page_aligned=True)
        skv, okv = _records(ss, **fields)
        ssess, osess = _sg_session(ss, si), StreamingSession(oi)
        ssess.slots["s"] = ss.SessionSlot(kv=skv, last_node="n")
        tokens = list(range(fields["kv_committed_len"]))
        osess.slots["s"] = SessionSlot("s", kv=okv, last_node="n", token_ids=tokens)
        # The next turn extends what the session computed (streaming sessions are append-only; SGLang reuses
        # min(committed, len(key)) without comparing tokens, kvcore only the tokens that agree: a documented
        # difference), or is cut short inside it (a retracted turn retried).
        if rng.random() < 0.5:
            key = tokens + list(range(900, 900 + rng.randint(0, 5)))
        else:
            key = tokens[: rng.randint(1, len(tokens))]
        sreq = SgReq(ss, "t", key, [], ss.ReqKvInfo())
        oreq = Req("t", key, session_id="s")
        sm = ssess.try_match_prefix(ss.MatchPrefixParams(key=ss.RadixKey(key), req=sreq))
        om = osess.try_match_prefix(key, oreq)
        where = f"case {case}: {fields} key={len(key)}"
        assert (sm is None) == (om is None), where
        assert oi.ranges == si.ranges and oi.unlocked == si.unlocked, where
        if sm is not None:
            assert torch.equal(sm.device_indices, om.device_indices), where
            assert sm.cache_protected_len == om.cache_protected_len, where
            assert _lens(oreq.kv) == _lens(sreq.kv), where
        else:
            assert "s" not in ssess.slots and "s" not in osess.slots, where


def test_held_counts_match(sgs):
    ss = sgs[False]
    rng = random.Random(7)
    for case in range(50):
        page = rng.choice([1, 4])
        si, oi = Inner(page), Inner(page)
        ssess, osess = _sg_session(ss, si), StreamingSession(oi)
        for i in range(rng.randint(0, 5)):
            _, _, fields = _random_record(rng, page)
            fields["req_pool_idx"] = i + 1 if rng.random() < 0.8 else None
            skv, okv = _records(ss, **fields)
            ssess.slots[f"s{i}"] = ss.SessionSlot(kv=skv)
            osess.slots[f"s{i}"] = SessionSlot(f"s{i}", kv=okv)
        for active in (None, set(), {1, 3}):
            assert osess.session_held_tokens(active) == ssess.session_held_tokens(active), case
            assert osess.session_held_req_count(active) == ssess.session_held_req_count(active), case

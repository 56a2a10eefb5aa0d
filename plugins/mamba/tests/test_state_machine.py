"""A hypothesis state machine over the mamba backend: requests through ``kvcore.Engine`` (admission
with COW, chunks, decode, finish, abort, retract, streaming-session turns), raw inserts with
explicit states, COW matches, locks and both evictions, on a small state pool so that slots
run short.  After every step: ``kvcore.InvariantChecker`` (full and mamba pools) and the
tree's own sanity check; teardown proves every slot, row and state is back.

Budget: ``KVCORE_HYPOTHESIS_PROFILE=dev|ci|long`` (``kvcore.testing.profiles``).
"""

from __future__ import annotations

import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from kvcore import Engine, RadixKey, StreamingSession, create_cache
from kvcore.testing import check_invariants, make_req
from kvcore.testing.profiles import state_machine_settings

STEMS = [[1, 1, 2, 2, 3], [4, 4, 4, 1], [5, 6]]


class MambaMachine(RuleBasedStateMachine):
    PAGE = 1
    STATES = 5

    def __init__(self) -> None:
        super().__init__()
        inner = create_cache("mamba", size=160, max_num_reqs=4, max_context_len=64, mamba_size=self.STATES,
                             mamba_cache_chunk_size=4, page_size=self.PAGE, mamba_track_interval=8)
        self.inner = inner
        self.cache = StreamingSession(inner)
        self.eng = Engine(self.cache, cache_prompt=True)
        self.live: list = []
        self.locks: list = []
        self.turns: dict[str, list[int]] = {}
        self.n = 0

    tails = st.lists(st.integers(0, 3), max_size=20)

    def _key(self, stem: int, tail: list[int]) -> list[int]:
        return STEMS[stem] + tail

    @rule(stem=st.integers(0, 2), tail=tails, session=st.sampled_from([None, None, "a", "b"]))
    def admit(self, stem, tail, session):
        if session is not None and any(r.session_id == session for r in self.live):
            return
        self.n += 1
        prompt = self._key(stem, tail) + [self.n % 4]
        if session is not None and self.eng.session_is_live(session):
            prompt = self.turns[session] + tail + [1]  # a follow-up turn extends the conversation
        if len(prompt) + 12 > 64:
            return
        req = make_req(f"q{self.n}", prompt, session_id=session)
        if self.eng.admit(req):
            self.live.append(req)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 50), chunk=st.sampled_from([2, 5, 30]))
    def extend(self, i, chunk):
        req = self.live[i % len(self.live)]
        if req.kv.kv_committed_len < len(req.fill_ids):
            self.eng.extend(req, req.kv.kv_committed_len + chunk)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 50))
    def decode(self, i):
        req = self.live[i % len(self.live)]
        if req.kv.kv_committed_len == len(req.fill_ids) and req.kv.kv_committed_len and req.seqlen + 2 < 64:
            self.eng.decode([req], [i % 4])

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 50), how=st.sampled_from(["finish", "finish", "noinsert", "abort", "retract"]))
    def leave(self, i, how):
        req = self.live.pop(i % len(self.live))
        if how in ("finish", "noinsert"):
            self.eng.finish(req, is_insert=how == "finish")
            if req.session_id is not None and self.eng.session_is_live(req.session_id):
                self.turns[req.session_id] = req.fill_ids
        elif how == "abort":
            self.eng.abort(req)
        else:
            self.eng.retract(req)
        assert not req.kv.is_held

    @rule(session=st.sampled_from(["a", "b"]))
    def end_session(self, session):
        if not any(r.session_id == session for r in self.live):
            self.eng.end_session(session)

    @rule(stem=st.integers(0, 2), tail=tails)
    def insert(self, stem, tail):
        key = self._key(stem, tail)
        key = key[: len(key) - len(key) % self.PAGE]  # a state belongs to a page-aligned key end
        if not key:
            return
        v = self.eng.alloc_slots(len(key))
        mv = self.inner.mamba_pool.alloc(1)
        if mv is None:
            self.inner.evict(0, mamba_num=1)
            mv = self.inner.mamba_pool.alloc(1)
        if v is None or mv is None:
            if v is not None:
                self.inner.token_to_kv_pool_allocator.free(v)
            if mv is not None:
                self.inner.mamba_pool.free(mv)
            return
        res = self.inner.insert(RadixKey(key), v, mamba_value=mv)
        assert res.duplicates_freed and res.prefix_len <= len(key)
        if res.mamba_exist:
            self.inner.mamba_pool.free(mv)

    @rule(stem=st.integers(0, 2), tail=tails)
    def cow_match(self, stem, tail):
        req = make_req("probe", self._key(stem, tail))
        try:
            m = self.inner.match_prefix(self._key(stem, tail), cow_mamba=True, req=req)
        except RuntimeError:
            return  # every state locked or held
        comp = req.kv.components.get("mamba")
        if m.prefix_len:
            assert comp is not None and comp.holds_mamba
            assert torch.equal(comp.mamba_cow_src_index, m.last_device_node.mamba_value)
            self.inner.mamba_pool.free(comp.mamba_pool_idx.reshape(1))
        else:
            assert comp is None or not comp.holds_mamba

    @rule(stem=st.integers(0, 2), tail=tails)
    def lock(self, stem, tail):
        node = self.inner.match_prefix(self._key(stem, tail)).last_device_node
        self.locks.append((node, self.inner.inc_lock_ref(node)))

    @precondition(lambda self: self.locks)
    @rule(i=st.integers(0, 50))
    def unlock(self, i):
        node, lock = self.locks.pop(i % len(self.locks))
        self.inner.dec_lock_ref(node, lock)

    @rule(n=st.integers(0, 60), m=st.integers(0, 4))
    def evict(self, n, m):
        before = self.inner.mamba_evictable_size()
        res = self.inner.evict(n, mamba_num=m)
        if n == 0:
            assert res.mamba_num_evicted == min(m, before)
        # With n > 0 the full walk runs first and its leaves take their states, counted (SGLang's unified tree).
        assert res.mamba_num_evicted <= before
        assert self.inner.mamba_evictable_size() == before - res.mamba_num_evicted

    @invariant()
    def pools_balance(self):
        check_invariants(self.cache, self.live)
        self.inner.sanity_check()

    def teardown(self):
        for req in self.live:
            self.eng.abort(req)
        for node, lock in reversed(self.locks):
            self.inner.dec_lock_ref(node, lock)
        for sid in list(self.cache.slots):
            self.eng.end_session(sid)
        check_invariants(self.cache)
        self.cache.reset()
        assert self.inner.mamba_pool.available_size() == self.STATES
        assert self.inner.token_to_kv_pool_allocator.available_size() == 160
        assert self.inner.req_to_token_pool.available_size() == 4
        check_invariants(self.cache)


def test_mamba_state_machine():
    run_state_machine_as_test(MambaMachine, settings=state_machine_settings(60, 40))


class PagedMambaMachine(MambaMachine):
    """Page size 4: extra-buffer mode; every request also holds two ping-pong slots (a session keeps them)."""

    PAGE = 4
    STATES = 9


def test_mamba_state_machine_page4():
    run_state_machine_as_test(PagedMambaMachine, settings=state_machine_settings(60, 40))

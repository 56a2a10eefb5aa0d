"""Random admit/extend/finish/session sequences through real pools; conservation after every step."""

import hypothesis.strategies as st
import torch
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvcore import InvariantChecker, Req, StreamingSession, create_cache, release_kv_cache
from kvcore.record import ceil_align


class ReleaseMachine(RuleBasedStateMachine):
    @initialize(page_size=st.sampled_from([1, 4]))
    def build(self, page_size):
        self.page = page_size
        self.cache = StreamingSession(
            create_cache("chunk", size=128, page_size=page_size, max_num_reqs=6, max_context_len=64)
        )
        self.live: list[Req] = []
        self.counter = 0

    def _grow(self, req, new_len) -> bool:
        """Allocate positions up to new_len (whole pages when paged); False if the pools run short."""
        kv = req.kv
        if not kv.is_held and self.cache.req_to_token_pool.alloc([req]) is None:
            return False
        have = ceil_align(kv.kv_allocated_len, self.page)
        need = ceil_align(new_len, self.page) - have
        if need > 0:
            slots = self.cache.token_to_kv_pool_allocator.alloc(need)
            if slots is None:
                if kv.kv_allocated_len == 0:
                    self.cache.req_to_token_pool.free(req)
                return False
            self.cache.req_to_token_pool.req_to_token[kv.req_pool_idx, have : have + need] = slots.to(torch.int32)
        kv.kv_allocated_len = new_len
        return True

    @rule(n=st.integers(1, 20), session=st.sampled_from([None, "s1", "s2"]))
    def admit(self, n, session):
        if session is not None and any(r.session_id == session for r in self.live):
            return  # one running turn per conversation
        self.counter += 1
        req = Req(f"r{self.counter}", list(range(n)), session_id=session)
        m = self.cache.match_prefix(req.fill_ids, req)
        start = m.prefix_len
        if not self._grow(req, max(start, n)):
            if session is not None and req.kv.is_held:
                # The turn could not be placed: keep the conversation's KV in its slot.
                req.kv.kv_committed_len = min(req.kv.kv_committed_len, req.kv.kv_allocated_len)
            return
        req.kv.kv_committed_len = max(start, n)
        self.live.append(req)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), extra=st.integers(1, 6), commit_all=st.booleans())
    def decode(self, data, extra, commit_all):
        req = data.draw(st.sampled_from(self.live))
        if req.kv.kv_allocated_len + extra > 64:
            return
        if self._grow(req, req.kv.kv_allocated_len + extra):
            committed = req.kv.kv_allocated_len if commit_all else req.kv.kv_allocated_len - 1
            req.output_ids += [7] * (committed - req.seqlen)
            req.kv.kv_committed_len = committed

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish(self, data):
        req = data.draw(st.sampled_from(self.live))
        self.live.remove(req)
        release_kv_cache(req, self.cache)
        assert not req.kv.is_held and req.kv.is_released

    @rule(session=st.sampled_from(["s1", "s2"]))
    def close_session(self, session):
        if any(r.session_id == session for r in self.live):
            return
        self.cache.release_session(session)

    @invariant()
    def nothing_leaked(self):
        InvariantChecker(self.cache).check(self.live)

    def teardown(self):
        for req in self.live:
            release_kv_cache(req, self.cache)
        self.cache.reset()
        (report,) = InvariantChecker(self.cache).check([])
        assert report.available == report.total


ReleaseMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
TestReleaseMachine = ReleaseMachine.TestCase

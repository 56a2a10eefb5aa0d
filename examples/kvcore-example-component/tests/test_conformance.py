"""kvcore's conformance kit on the example-component backend: every scenario, the state machine and the fuzz run.

Three generic scenarios assume that every cached prefix can be reused.  With the
``stamp`` component a match ends only where an insert ended (a request boundary),
so they run here in the same shape with that rule, as kvcore-unified runs them for
the (full, mamba) set: a hit reaches the deepest stamped node of the path.
"""

import random

from kvcore.keys import RadixKey
from kvcore.record import floor_align
from kvcore.testing import PrefixCacheConformance, admit, check_invariants, decode, finish, make_req, prefill
from kvcore.testing.conformance import _insert_owned, _toks


class TestExampleComponentConformance(PrefixCacheConformance):
    backend = "example-component"

    def test_match_is_page_aligned(self, build, page_size):
        cache = build()
        key = list(range(1, 2 * page_size + 1))
        _insert_owned(cache, RadixKey(key), True)
        for probe_len in range(0, 2 * page_size + 2):
            got = cache.match_prefix(key[:probe_len] + [1000]).device_indices.numel()
            # Only the insert's end is stamped: a shorter probe splits the node and ends on its unstamped upper half.
            assert got == (len(key) if probe_len >= len(key) else 0)
        check_invariants(cache)

    def test_chunked_prefill_then_finish(self, build, page_size):
        cache = build()
        rng = random.Random(7)
        prompt = _toks(rng, 5 * page_size + 3)
        req = make_req("chunked", prompt)
        assert admit(cache, req)
        chunk = 2 * page_size + 1
        boundaries = []
        while req.kv.kv_committed_len < len(prompt):
            assert prefill(cache, req, req.kv.kv_committed_len + chunk)
            kv = req.kv
            if kv.kv_committed_len < len(prompt):
                # Each chunk is a boundary: the request resumes from its own stamp.
                assert kv.cache_protected_len == floor_align(kv.kv_committed_len, page_size)
                assert req.prefix_indices.numel() == kv.kv_committed_len
                boundaries.append(kv.cache_protected_len)
            check_invariants(cache, [req])
        decode(cache, req, 3)
        boundaries.append(floor_align(req.kv.kv_committed_len, page_size))
        finish(cache, req)
        check_invariants(cache)
        # Sharing the prompt only, the next request resumes from the deepest boundary inside the prompt.
        other = make_req("other", prompt + [1, 2])
        assert admit(cache, other)
        assert other.kv.cache_protected_len == max(b for b in boundaries if b <= len(prompt))
        assert prefill(cache, other)
        finish(cache, other)
        again = make_req("again", prompt + [1, 2, 3])
        assert admit(cache, again)
        assert again.kv.cache_protected_len == floor_align(len(prompt) + 2, page_size)  # where `other` ended
        finish(cache, again)
        check_invariants(cache)

    def test_two_requests_share_a_prefix(self, build, page_size):
        cache = build()
        rng = random.Random(3)
        system = _toks(rng, 2 * page_size)
        # A boundary at the end of the system prompt: a chunk that stops there.
        a = make_req("a", system + [1])
        assert admit(cache, a) and prefill(cache, a, len(system), chunked=True)
        finish(cache, a, is_insert=False)
        b = make_req("b", system + _toks(rng, page_size + 2))
        c = make_req("c", system + _toks(rng, 3))
        assert admit(cache, b) and admit(cache, c)
        assert b.kv.cache_protected_len == len(system)
        assert c.kv.cache_protected_len == len(system)
        assert cache.protected_size() == len(system)
        check_invariants(cache, [b, c])
        assert prefill(cache, b) and prefill(cache, c)
        decode(cache, b, 2)
        check_invariants(cache, [b, c])
        finish(cache, c)
        check_invariants(cache, [b])
        finish(cache, b)
        assert cache.protected_size() == 0
        check_invariants(cache)

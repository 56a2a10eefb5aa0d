"""The conformance suite on each component set of ``unified``: generic scenarios, and the SWA ones for (full, swa)."""

import random

from kvcore.keys import RadixKey
from kvcore.record import floor_align
from kvcore.testing import PrefixCacheConformance, admit, check_invariants, decode, finish, make_req, prefill
from kvcore.testing.conformance import _insert_owned, _toks
from kvcore.testing.swa import SWACacheConformance


class TestUnifiedFullConformance(PrefixCacheConformance):
    backend = "unified"
    backend_options = {"components": ("full",)}

    def self_check(self, cache) -> None:
        cache.sanity_check()


class TestUnifiedFullSWAConformance(SWACacheConformance):
    backend = "unified"
    backend_options = {**SWACacheConformance.backend_options, "components": ("full", "swa")}
    swa_extra_options = {"components": ("full", "swa")}

    def self_check(self, cache) -> None:
        cache.sanity_check()


class TestUnifiedFullMambaConformance(PrefixCacheConformance):
    """(full, mamba) at page size 1.  As for the ``mamba`` backend, three generic scenarios assume
    any cached prefix can be reused; a hybrid model resumes only where a state was kept, so they
    run in the same shape with that rule (a hit reaches the deepest node with a state)."""

    backend = "unified"
    backend_options = {"components": ("full", "mamba")}
    page_sizes = (1,)

    def self_check(self, cache) -> None:
        cache.sanity_check()

    def test_match_is_page_aligned(self, build, page_size):
        cache = build()
        key = list(range(1, 2 * page_size + 1))
        _insert_owned(cache, RadixKey(key), True)
        for probe_len in range(0, 2 * page_size + 2):
            got = cache.match_prefix(key[:probe_len] + [1000]).device_indices.numel()
            assert got == (len(key) if probe_len >= len(key) else 0)
        cache.sanity_check()
        check_invariants(cache)

    def test_chunked_prefill_then_finish(self, build, page_size):
        cache = build()
        rng = random.Random(7)
        prompt = _toks(rng, 5 * page_size + 3)
        req = make_req("chunked", prompt)
        assert admit(cache, req)
        chunk = 2 * page_size + 1
        snapshots = []
        while req.kv.kv_committed_len < len(prompt):
            assert prefill(cache, req, req.kv.kv_committed_len + chunk)
            kv = req.kv
            if kv.kv_committed_len < len(prompt):
                assert kv.cache_protected_len == floor_align(kv.kv_committed_len, page_size)
                snapshots.append(kv.cache_protected_len)
            check_invariants(cache, [req])
        decode(cache, req, 3)
        finish(cache, req)
        cache.sanity_check()
        check_invariants(cache)
        other = make_req("other", prompt + [1, 2])
        assert admit(cache, other)
        assert other.kv.cache_protected_len == snapshots[-1]
        assert prefill(cache, other)
        finish(cache, other)
        again = make_req("again", prompt + [1, 2, 3])
        assert admit(cache, again)
        assert again.kv.cache_protected_len == len(prompt) + 2
        finish(cache, again)
        cache.sanity_check()
        check_invariants(cache)

    def test_two_requests_share_a_prefix(self, build, page_size):
        cache = build()
        rng = random.Random(3)
        system = _toks(rng, 2 * page_size)
        a = make_req("a", system + [1])
        assert admit(cache, a) and prefill(cache, a, len(system), chunked=True)
        finish(cache, a, is_insert=False)
        b = make_req("b", system + _toks(rng, page_size + 2))
        c = make_req("c", system + _toks(rng, 3))
        assert admit(cache, b) and admit(cache, c)
        assert b.kv.cache_protected_len == len(system)
        assert c.kv.cache_protected_len == len(system)
        assert cache.protected_size() == len(system)
        assert cache.stats()["cow_copies"] == 2
        check_invariants(cache, [b, c])
        assert prefill(cache, b) and prefill(cache, c)
        decode(cache, b, 2)
        finish(cache, c)
        finish(cache, b)
        assert cache.protected_size() == 0
        cache.sanity_check()
        check_invariants(cache)

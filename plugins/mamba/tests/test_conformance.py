"""The generic conformance suite for ``mamba`` at page sizes 1 and 4 (4: SGLang's extra-buffer mode).

Three generic scenarios assume that any cached prefix can be reused (radix
semantics).  A hybrid model can resume only where a state snapshot was kept, so
``mamba`` runs them in the same shape with that rule: a hit reaches the deepest
node on the path that has a state.
"""

import random

from kvcore.keys import RadixKey
from kvcore.record import floor_align
from kvcore.testing import PrefixCacheConformance, admit, check_invariants, decode, finish, make_req, prefill
from kvcore.testing.conformance import _insert_owned, _toks


class TestMamba(PrefixCacheConformance):
    backend = "mamba"
    page_sizes = (1,)

    def self_check(self, cache) -> None:
        cache.sanity_check()

    def test_match_is_page_aligned(self, build, page_size):
        # A match stops at a node with a state: only probes covering the whole inserted key hit.
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
                # Each chunk leaves a state snapshot in the tree at the committed length (page 1),
                # at its last chunk boundary (pages: chunk = page here).
                assert kv.cache_protected_len == floor_align(kv.kv_committed_len, page_size)
                assert req.prefix_indices.numel() == kv.kv_committed_len
                snapshots.append(kv.cache_protected_len)
            check_invariants(cache, [req])
        decode(cache, req, 3)
        finish(cache, req)
        cache.sanity_check()
        check_invariants(cache)
        other = make_req("other", prompt + [1, 2])
        assert admit(cache, other)
        # The prompt's end has no snapshot (the finished request cached prompt + output): the hit
        # is the last chunk snapshot.
        assert other.kv.cache_protected_len == snapshots[-1]
        assert prefill(cache, other)
        finish(cache, other)
        # Now the full prompt + [1, 2] is cached with its state.
        again = make_req("again", prompt + [1, 2, 3])
        assert admit(cache, again)
        if page_size == 1:
            assert again.kv.cache_protected_len == len(prompt) + 2
        else:
            # Extra-buffer mode snapshots a prefill at its branching point (where "other" left the
            # cached path, floored to the chunk) rather than at its end (SGLang's
            # mamba_branching_seqlen tracking): that is where "again" resumes.
            assert again.kv.cache_protected_len == floor_align(len(prompt), page_size)
        finish(cache, again)
        cache.sanity_check()
        check_invariants(cache)

    def test_two_requests_share_a_prefix(self, build, page_size):
        cache = build()
        rng = random.Random(3)
        system = _toks(rng, 2 * page_size)
        # The system prompt alone ran once: its end state is in the tree.
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
        check_invariants(cache, [b, c])
        finish(cache, c)
        check_invariants(cache, [b])
        finish(cache, b)
        assert cache.protected_size() == 0
        cache.sanity_check()
        check_invariants(cache)


class TestMambaPaged(TestMamba):
    """Page size 4: SGLang's extra-buffer mode (ping-pong tracking slots, snapshots at chunk boundaries).

    The chunk size and the decode track interval are one page here, so every page-aligned
    computed length can be a snapshot; what the tree keeps is still only where a snapshot was
    tracked (the last chunk boundary of each prefill extend, every decode boundary).
    """

    page_sizes = (4,)
    backend_options = {"mamba_cache_chunk_size": 4, "mamba_track_interval": 4}

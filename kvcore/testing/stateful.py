"""The conformance kit for trees whose matches end only where a state was kept (Mamba, your component).

Three generic scenarios of :class:`kvcore.testing.PrefixCacheConformance` assume that
any cached prefix can be reused.  A component whose :meth:`~kvcore.components.TreeComponent.validator`
accepts only some nodes (Mamba: a node with a recurrent state; the example's ``stamp``: a
node where an insert ended) resumes a request only at such a node, so a backend
made of one subclasses :class:`StatefulMatchConformance` instead; the scenarios keep
their shape under that rule (a hit reaches the deepest accepted node of the path)::

    class TestMyStatefulConformance(StatefulMatchConformance):
        backend = "my-backend"
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvcore.keys import RadixKey
from kvcore.record import floor_align
from kvcore.testing.conformance import PrefixCacheConformance, insert_owned, random_tokens
from kvcore.testing.helpers import admit, check_invariants, finish, make_req, prefill

if TYPE_CHECKING:
    from kvcore.cache import BasePrefixCache

__all__ = ["StatefulMatchConformance"]


class StatefulMatchConformance(PrefixCacheConformance):
    """:class:`PrefixCacheConformance` for a tree whose match ends only on a node a component accepts.

    Override :meth:`resumed_after_branch` where the backend keeps its state at
    another length than the request's end, and :meth:`check_shared_admission`
    to assert what two admissions from one cached state cost (Mamba: two copies).
    """

    def self_check(self, cache: Any) -> None:
        cache.sanity_check()

    def resumed_after_branch(self, prompt_len: int, page_size: int) -> int:
        """Where a request resumes after another finished at ``prompt + 2`` tokens: that request's end."""
        return floor_align(prompt_len + 2, page_size)

    def check_shared_admission(self, cache: BasePrefixCache) -> None:
        """After two requests were admitted from one cached node (nothing to check by default)."""

    def test_match_is_page_aligned(self, build: Callable[..., BasePrefixCache], page_size: int) -> None:
        # Only the insert's end is accepted: a shorter probe splits the node and ends on its upper half.
        cache = build()
        key = list(range(1, 2 * page_size + 1))
        insert_owned(cache, RadixKey(key), True)
        for probe_len in range(0, 2 * page_size + 2):
            got = cache.match_prefix(key[:probe_len] + [1000]).device_indices.numel()
            assert got == (len(key) if probe_len >= len(key) else 0)
        self.self_check(cache)
        check_invariants(cache)

    def test_chunked_prefill_then_finish(self, build: Callable[..., BasePrefixCache], page_size: int) -> None:
        cache = build()
        # Each chunk leaves an accepted node at its (page-floored) end, and the finish one at its own.
        prompt, boundaries = self.run_chunked_prompt(cache, page_size)
        self.self_check(cache)
        check_invariants(cache)
        # A request sharing the prompt only resumes from the deepest boundary inside the prompt.
        other = make_req("other", prompt + [1, 2])
        assert admit(cache, other)
        assert other.kv.cache_protected_len == max(b for b in boundaries if b <= len(prompt))
        assert prefill(cache, other)
        finish(cache, other)
        again = make_req("again", prompt + [1, 2, 3])
        assert admit(cache, again)
        assert again.kv.cache_protected_len == self.resumed_after_branch(len(prompt), page_size)
        finish(cache, again)
        self.self_check(cache)
        check_invariants(cache)

    def test_two_requests_share_a_prefix(self, build: Callable[..., BasePrefixCache], page_size: int) -> None:
        cache = build()
        rng = random.Random(3)
        system = random_tokens(rng, 2 * page_size)
        # The system prompt alone ran once (a chunk that stops at its end): the tree accepts that node.
        a = make_req("a", system + [1])
        assert admit(cache, a) and prefill(cache, a, len(system), chunked=True)
        finish(cache, a, is_insert=False)
        b = make_req("b", system + random_tokens(rng, page_size + 2))
        c = make_req("c", system + random_tokens(rng, 3))
        assert admit(cache, b) and admit(cache, c)
        assert b.kv.cache_protected_len == len(system)
        assert c.kv.cache_protected_len == len(system)
        assert cache.protected_size() == len(system)
        self.check_shared_admission(cache)
        self.run_two_sharers(cache, b, c)
        self.self_check(cache)

"""kvcore's conformance suite, shipped with the package so every backend runs it.

A backend author (ours or a third party) subclasses
:class:`PrefixCacheConformance` in a pytest module and provides a ``make_cache``
fixture that returns a callable building the backend from options, the way
fsspec ships its abstract filesystem tests::

    # tests/test_conformance.py of a plugin distribution
    import kvcore
    import pytest
    from kvcore.testing import PrefixCacheConformance


    class TestMyCacheConformance(PrefixCacheConformance):
        supports_prefix_reuse = True          # False: match never hits (chunk-like)
        page_sizes = (1, 16)                  # page sizes the backend supports
        backend_options = {"eviction_policy": "lru"}   # passed on every build

        @pytest.fixture
        def make_cache(self):
            def build(**options):             # size, page_size, max_num_reqs, max_context_len, ...
                return kvcore.create_cache("my-backend", **options)
            return build

Run it with ``pytest --import-mode=importlib``.  The class holds scenario tests
(no reuse for chunk caches, finished requests cache or free every slot,
lock/unlock accounting, eviction frees only unlocked entries, insert returns the
cached prefix length, extra_key isolation, bad input leaves state unchanged,
chunked prefill then finish, streaming sessions, reset returns every slot) and a
hypothesis state machine over match/insert/lock/unlock/evict/admit/prefill
chunk/decode/finish.  Every test ends with ``kvcore.InvariantChecker``.

The engine-protocol helpers (``make_req``, ``admit``, ``prefill``, ``decode``,
``finish``, ``run_request``) are reusable by other suites and benchmarks.
"""

from kvcore.testing.helpers import (
    admit,
    alloc_slots,
    check_invariants,
    decode,
    extend_slots,
    finish,
    make_req,
    pool_total,
    prefill,
    run_request,
)
from kvcore.testing.conformance import CacheStateMachine, PrefixCacheConformance, snapshot

__all__ = [
    "PrefixCacheConformance",
    "CacheStateMachine",
    "snapshot",
    "make_req",
    "admit",
    "prefill",
    "decode",
    "finish",
    "run_request",
    "alloc_slots",
    "extend_slots",
    "check_invariants",
    "pool_total",
]

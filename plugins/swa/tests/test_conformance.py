"""The conformance suite: generic + SWA scenarios for ``swa`` and ``swa-chunk``; generic for the pure-SWA pair.

The SWA scenarios are about two pools (full and window), tombstones and window
locks, which a pure-SWA model (one window pool, a plain radix tree) does not have;
its window and floor scenarios are in ``test_pure.py``.
"""

from kvcore.testing import PrefixCacheConformance
from kvcore.testing.swa import SWACacheConformance


class TestSWARadixConformance(SWACacheConformance):
    backend = "swa"

    def self_check(self, cache) -> None:
        cache.sanity_check()  # the tree recounts its sizes and LRU lists


class TestSWAChunkConformance(SWACacheConformance):
    backend = "swa-chunk"


class TestPureSWARadixConformance(PrefixCacheConformance):
    # A window longer than any generic scenario's request: decoded tokens stay cached as
    # the generic scenarios expect; the window itself is tested in test_pure.py.
    backend = "swa-pure"
    backend_options = {"sliding_window_size": 4096}


class TestPureSWAChunkConformance(PrefixCacheConformance):
    backend = "swa-pure-chunk"
    backend_options = {"sliding_window_size": 8}


class TestSWAKeepSplitRecencyConformance(TestSWARadixConformance):
    # SGLang 0.5.23's split rule: the lower part keeps its place in the window LRU.
    backend_options = {**TestSWARadixConformance.backend_options, "split_recency": "keep"}

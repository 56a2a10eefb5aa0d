"""The conformance suite (generic + SWA scenarios) for ``swa`` and ``swa-chunk``."""

from kvcore.testing.swa import SWACacheConformance


class TestSWARadixConformance(SWACacheConformance):
    backend = "swa"

    def self_check(self, cache) -> None:
        cache.sanity_check()  # the tree recounts its sizes and LRU lists


class TestSWAChunkConformance(SWACacheConformance):
    backend = "swa-chunk"

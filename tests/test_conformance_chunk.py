"""The conformance suite against the built-in chunk backend (no prefix reuse)."""

from kvcore.testing import PrefixCacheConformance


class TestChunkConformance(PrefixCacheConformance):
    backend = "chunk"

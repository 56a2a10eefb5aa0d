"""The conformance suite against the built-in chunk backend (no prefix reuse)."""

import pytest

import kvcore
from kvcore.testing import PrefixCacheConformance


class TestChunkConformance(PrefixCacheConformance):
    supports_prefix_reuse = False
    page_sizes = (1, 16)

    @pytest.fixture
    def make_cache(self):
        def build(**options):
            return kvcore.create_cache("chunk", **options)

        return build

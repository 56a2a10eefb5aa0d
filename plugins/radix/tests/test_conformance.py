"""kvcore's conformance suite against the radix backend."""

import pytest

import kvcore
from kvcore.testing import PrefixCacheConformance


class TestRadixConformance(PrefixCacheConformance):
    supports_prefix_reuse = True
    page_sizes = (1, 16)

    @pytest.fixture
    def make_cache(self):
        def build(**options):
            return kvcore.create_cache("radix", **options)

        return build


class TestRadixLFUConformance(TestRadixConformance):
    backend_options = {"eviction_policy": "lfu"}
    state_machine_examples = 8

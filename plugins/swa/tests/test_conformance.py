"""The conformance suite (generic + SWA scenarios) for ``swa`` and ``swa-chunk``."""

import pytest

import kvcore
from kvcore.testing.swa import SWACacheConformance


class TestSWARadixConformance(SWACacheConformance):
    supports_prefix_reuse = True
    page_sizes = (1, 16)

    @pytest.fixture
    def make_cache(self):
        def build(**options):
            return kvcore.create_cache("swa", **options)

        return build


class TestSWAChunkConformance(SWACacheConformance):
    supports_prefix_reuse = False
    page_sizes = (1, 16)

    @pytest.fixture
    def make_cache(self):
        def build(**options):
            return kvcore.create_cache("swa-chunk", **options)

        return build

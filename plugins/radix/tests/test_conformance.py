"""kvcore's conformance suite against the radix backend."""

from kvcore.testing import PrefixCacheConformance


class TestRadixConformance(PrefixCacheConformance):
    backend = "radix"


class TestRadixLFUConformance(PrefixCacheConformance):
    backend = "radix"
    backend_options = {"eviction_policy": "lfu"}
    state_machine_examples = 8

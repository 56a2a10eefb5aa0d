"""kvcore's conformance kit on the example backend: every scenario, the state machine and the fuzz run."""

from kvcore.testing import PrefixCacheConformance


class TestExampleConformance(PrefixCacheConformance):
    backend = "example"

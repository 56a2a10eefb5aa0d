"""kvcore's conformance suite against the npu backend: the NPU pools at page 128, on the CPU."""

from kvcore.testing import PrefixCacheConformance


class TestNpu(PrefixCacheConformance):
    backend = "npu"

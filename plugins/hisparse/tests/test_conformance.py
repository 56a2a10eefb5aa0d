"""The conformance suite for ``hisparse``."""

from kvcore.testing import PrefixCacheConformance


class TestHiSparseConformance(PrefixCacheConformance):
    backend = "hisparse"
    # Small buffers so the kit's pools hold one (device_buffer_size + one page).  The kit reads
    # free slots from allocator.available_size(), which is SGLang's min(logical, device): with a
    # ratio of 1 both pools have the kit's size (tests/test_hisparse.py runs ratio 2).
    backend_options = {"device_buffer_size": 16, "top_k": 8, "host_to_device_ratio": 1}

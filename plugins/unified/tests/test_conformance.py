"""The conformance suite on each component set of ``unified``: generic scenarios, and the SWA ones for (full, swa)."""

from kvcore.testing import PrefixCacheConformance
from kvcore.testing.stateful import StatefulMatchConformance
from kvcore.testing.swa import SWACacheConformance


class TestUnifiedFullConformance(PrefixCacheConformance):
    backend = "unified"
    backend_options = {"components": ("full",)}

    def self_check(self, cache) -> None:
        cache.sanity_check()


class TestUnifiedFullSWAConformance(SWACacheConformance):
    backend = "unified"
    backend_options = {**SWACacheConformance.backend_options, "components": ("full", "swa")}
    swa_extra_options = {"components": ("full", "swa")}

    def self_check(self, cache) -> None:
        cache.sanity_check()


class TestUnifiedFullMambaConformance(StatefulMatchConformance):
    """(full, mamba) at page size 1: as for the ``mamba`` backend, a hybrid model resumes only
    where a state was kept (the kit's stateful variant: a hit reaches the deepest node with one)."""

    backend = "unified"
    backend_options = {"components": ("full", "mamba")}
    page_sizes = (1,)

    def check_shared_admission(self, cache) -> None:
        assert cache.stats()["cow_copies"] == 2  # each admission copies the cached state

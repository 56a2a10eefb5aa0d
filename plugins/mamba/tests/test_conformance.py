"""The conformance suite for ``mamba`` at page sizes 1 and 4 (4: SGLang's extra-buffer mode).

A hybrid model can resume only where a state snapshot was kept, so ``mamba`` runs the
kit's stateful variant (:class:`kvcore.testing.stateful.StatefulMatchConformance`): a hit
reaches the deepest node on the path that has a state.
"""

from kvcore.record import floor_align
from kvcore.testing.stateful import StatefulMatchConformance


class TestMamba(StatefulMatchConformance):
    backend = "mamba"
    page_sizes = (1,)

    def resumed_after_branch(self, prompt_len: int, page_size: int) -> int:
        if page_size == 1:
            return prompt_len + 2
        # Extra-buffer mode snapshots a prefill at its branching point (where the other request left
        # the cached path, floored to the chunk) rather than at its end (SGLang's
        # mamba_branching_seqlen tracking): that is where the next request resumes.
        return floor_align(prompt_len, page_size)

    def check_shared_admission(self, cache) -> None:
        assert cache.stats()["cow_copies"] == 2  # each admission copies the cached state


class TestMambaPaged(TestMamba):
    """Page size 4: SGLang's extra-buffer mode (ping-pong tracking slots, snapshots at chunk boundaries).

    The chunk size and the decode track interval are one page here, so every page-aligned
    computed length can be a snapshot; what the tree keeps is still only where a snapshot was
    tracked (the last chunk boundary of each prefill extend, every decode boundary).
    """

    page_sizes = (4,)
    backend_options = {"mamba_cache_chunk_size": 4, "mamba_track_interval": 4}


class TestMambaKeepSplitRecency(TestMamba):
    # SGLang 0.5.23's split rule: the lower part keeps its place in the state LRU.
    backend_options = {**TestMamba.backend_options, "split_recency": "keep"}

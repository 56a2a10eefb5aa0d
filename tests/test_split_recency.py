"""``split_recency``: what a split does to the node's place in each component's LRU.

``refresh`` (the default, SGLang 0.5.19's ``UnifiedRadixCache``) puts both parts at the front, the
lower part first; ``keep`` (SGLang 0.5.23's) leaves the lower part where it was and puts the upper
part right behind it.  kvcore-sglang's ``test_v0_5_23_tree_differential.py`` checks ``keep``
against SGLang 0.5.23's own trees; the 0.5.19 differentials check ``refresh``.
"""

from __future__ import annotations

import pytest

import kvcore
from kvcore import InvariantChecker, RadixKey
from kvcore.factory import ConfigError

pytestmark = pytest.mark.skipif(not {"swa", "mamba"} <= set(kvcore.available_backends()),
                                reason="needs kvcore-swa and kvcore-mamba")


def _order(cache, component: str) -> list[list[int]]:
    """The component's LRU, least recently used first, as the nodes' own tokens."""
    return [list(n.key) for n in cache.by_name[component].lru]


@pytest.mark.parametrize("recency, after", [
    # Before the split: [1, 2], [3, 4, 5, 6] (cut one window below its end), [7, 8, 9].
    ("refresh", [[7, 8, 9], [5, 6], [1, 2], [3, 4]]),
    ("keep", [[5, 6], [7, 8, 9], [1, 2], [3, 4]]),
])
def test_a_split_by_a_match_and_the_window_lru(recency: str, after: list[list[int]]) -> None:
    cache = kvcore.create_cache("swa", size=64, swa_size=64, sliding_window_size=4, split_recency=recency)
    alloc = cache.token_to_kv_pool_allocator
    cache.insert(RadixKey([1, 2, 3, 4, 5, 6]), alloc.alloc(6))
    cache.insert(RadixKey([7, 8, 9]), alloc.alloc(3))
    assert _order(cache, "swa") == [[1, 2], [3, 4, 5, 6], [7, 8, 9]]
    cache.match_prefix(RadixKey([1, 2, 3, 4]))  # cuts [3, 4, 5, 6] after two tokens; touches [3, 4] and [1, 2]
    assert _order(cache, "swa") == after
    cache.sanity_check()
    InvariantChecker(cache).check()


@pytest.mark.parametrize("recency, after", [("refresh", [[9, 9], [3, 4]]), ("keep", [[3, 4], [9, 9]])])
def test_a_split_by_a_match_and_the_state_lru(recency: str, after: list[list[int]]) -> None:
    cache = kvcore.create_cache("mamba", size=64, mamba_size=8, split_recency=recency)
    alloc = cache.token_to_kv_pool_allocator
    cache.insert(RadixKey([1, 2, 3, 4]), alloc.alloc(4), mamba_value=cache.mamba_pool.alloc(1))
    cache.insert(RadixKey([9, 9]), alloc.alloc(2), mamba_value=cache.mamba_pool.alloc(1))
    cache.match_prefix(RadixKey([1, 2]))  # the upper part [1, 2] has no state: only [3, 4] is in the LRU
    assert _order(cache, "mamba") == after
    cache.sanity_check()
    InvariantChecker(cache).check()


def test_the_option_is_checked_by_name() -> None:
    with pytest.raises(ConfigError, match="split_recency"):
        kvcore.create_cache("swa", size=64, swa_size=64, sliding_window_size=4, split_recency="sometimes")
    # RadixCache keeps no component LRU: its one rule is the only one it takes.
    with pytest.raises(ConfigError, match="split_recency.*'refresh'"):
        kvcore.create_cache("radix", size=64, split_recency="keep")
    assert kvcore.create_cache("unified", size=64, split_recency="keep").split_keeps_recency

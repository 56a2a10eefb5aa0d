"""Tiers below the device tree: a host pool of K/V pages, then a shared store (``kvcore.stores``).

A tree backend gains them without a change to its internals: its factory is
wrapped with :func:`tiered` and its config extends :class:`TieredCacheConfig`
(options ``host_size``, ``store`` and ``host_write_policy``).  See :mod:`kvcore.tiers.tiered_cache`.
"""

from kvcore.tiers.config import HOST_WRITE_POLICIES, HostWritePolicy, TieredCacheConfig
from kvcore.tiers.host import HostTier
from kvcore.tiers.tiered_cache import TierCounters, TieredCacheMixin, page_codec_layout, tiered

__all__ = [
    "HOST_WRITE_POLICIES", "HostTier", "HostWritePolicy", "TierCounters", "TieredCacheConfig", "TieredCacheMixin",
    "page_codec_layout", "tiered",
]

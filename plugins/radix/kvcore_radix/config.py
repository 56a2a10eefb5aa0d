"""Options of the ``radix`` backend: the core tree's full-only set with SGLang RadixCache's answers."""

from __future__ import annotations

from kvcore.tree.unified_config import RadixTreeConfig

__all__ = ["RadixConfig"]


class RadixConfig(RadixTreeConfig):
    """Options of the ``radix`` backend: the common pool options plus ``eviction_policy`` (every
    registered policy), ``enable_kv_events``, ``disable``, ``key_validation`` and the tiers
    (``host_size``, ``store``, ``store_layout``, ...).  ``components`` is ``("full",)``, the only set
    this backend is (:class:`kvcore.tree.unified_config.RadixTreeConfig` says what differs from
    ``unified`` with that set)."""

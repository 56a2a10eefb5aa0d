"""Options of the ``radix`` backend."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kvcore.tiers import TieredCacheConfig

__all__ = ["RadixConfig"]


class RadixConfig(TieredCacheConfig):
    """Options of the ``radix`` backend: the common pool options plus
    ``eviction_policy``, ``enable_kv_events``, ``disable``, ``key_validation`` and the tiers
    (``host_size``, ``store``, ``store_layout``)."""

    key_validation: Literal["full", "stored"] = Field(
        "full",
        description="full: every key is checked (TypeError/ValueError on bad ids); "
        "stored: only ids the tree stores are checked, match_prefix skips the unmatched tail (faster)",
    )

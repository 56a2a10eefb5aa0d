"""Options of the ``radix`` backend."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kvcore.config import TreeCacheConfig

__all__ = ["RadixConfig"]


class RadixConfig(TreeCacheConfig):
    """Options of the ``radix`` backend: the common pool options plus
    ``eviction_policy``, ``enable_kv_events``, ``disable`` and ``key_validation``."""

    key_validation: Literal["full", "stored"] = Field(
        "full",
        description="full: every key is checked (TypeError/ValueError on bad ids); "
        "stored: only ids the tree stores are checked, match_prefix skips the unmatched tail (faster)",
    )

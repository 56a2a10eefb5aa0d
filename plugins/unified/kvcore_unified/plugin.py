"""Entry point ``unified`` in group ``kvcore``: the ``unified`` backend and its two presets.

The tree is the core's (:mod:`kvcore.tree.unified`); the components come from the
distributions that register them (``full`` from kvcore, ``swa`` from kvcore-swa,
``mamba`` from kvcore-mamba, a third party's from its own).
"""

from __future__ import annotations

from collections.abc import Callable

from kvcore import hookimpl
from kvcore.tiers import tiered
from kvcore.tree.unified import UnifiedRadixCache
from kvcore.tree.unified_config import UnifiedConfig, UnifiedPools, require_full_only
from kvcore_unified.config import UnifiedMambaConfig, UnifiedSWAConfig


@hookimpl
def kvcore_register_backends(register: Callable[..., None]) -> None:
    register(
        "unified",
        tiered(UnifiedRadixCache, check=require_full_only),
        config=UnifiedConfig,
        pools=UnifiedPools(),
        description=(
            "One radix tree with pluggable components (full, swa, mamba, a plugin's): shared eviction "
            "quota, cascade by priority (SGLang UnifiedRadixCache)"
        ),
    )
    register(
        "unified-swa",
        tiered(UnifiedRadixCache, check=require_full_only),
        config=UnifiedSWAConfig,
        pools=UnifiedPools(),
        description="unified with components (full, swa) by default (its window options declared for the bench)",
        reference="swa",
    )
    register(
        "unified-mamba",
        tiered(UnifiedRadixCache, check=require_full_only),
        config=UnifiedMambaConfig,
        pools=UnifiedPools(),
        description="unified with components (full, mamba) by default",
        reference="mamba",
    )

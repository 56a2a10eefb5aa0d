"""Entry point ``unified`` in group ``kvcore``: the ``unified`` backend and the ``full``/``swa`` components."""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

from kvcore import hookimpl
from kvcore.config import CacheInitParams
from kvcore.tiers import tiered
from kvcore_unified.components import FullComponent, SWAComponent, SWAOptions
from kvcore_unified.config import UnifiedConfig, UnifiedMambaConfig, UnifiedPools, UnifiedSWAConfig
from kvcore_unified.mamba import MambaComponent, MambaOptions
from kvcore_unified.tree import UnifiedRadixCache


def _full_only(params: CacheInitParams) -> None:
    # The host tier and the store hold full-attention pages; window and state components have no such page.
    components = tuple(cast(UnifiedConfig, params.config).components)
    if components != ("full",):
        raise ValueError(f"host_size and store need components=('full',), got {components!r}")


@hookimpl
def kvcore_register_backends(register: Callable[..., None]) -> None:
    register(
        "unified",
        tiered(UnifiedRadixCache, check=_full_only),
        config=UnifiedConfig,
        pools=UnifiedPools(),
        description=(
            "One radix tree with pluggable components (full, swa, mamba, a plugin's): shared eviction "
            "quota, cascade by priority (SGLang UnifiedRadixCache)"
        ),
    )
    register(
        "unified-swa",
        tiered(UnifiedRadixCache, check=_full_only),
        config=UnifiedSWAConfig,
        pools=UnifiedPools(),
        description="unified with components (full, swa) by default (its window options declared for the bench)",
        reference="swa",
    )
    register(
        "unified-mamba",
        tiered(UnifiedRadixCache, check=_full_only),
        config=UnifiedMambaConfig,
        pools=UnifiedPools(),
        description="unified with components (full, mamba) by default",
        reference="mamba",
    )


@hookimpl
def kvcore_register_components(register: Callable[..., None]) -> None:
    register("full", FullComponent, description="full-attention KV slots: path locks, leaf eviction by recency")
    register("swa", SWAComponent, options=SWAOptions,
             description="sliding-window slots: tombstones, window locks, window-only recency")
    register("mamba", MambaComponent, options=MambaOptions,
             description="recurrent-state slots: one per node, single-node locks, copy-on-write on match")

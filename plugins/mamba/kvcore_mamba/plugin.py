"""Entry point ``mamba`` in group ``kvcore``: the ``mamba`` component and the ``mamba`` backend."""

from __future__ import annotations

from collections.abc import Callable

from kvcore import hookimpl
from kvcore.tiers import tiered
from kvcore.tree.unified import UnifiedRadixCache
from kvcore.tree.unified_config import UnifiedPools, require_full_only
from kvcore_mamba.component import MambaComponent, MambaOptions
from kvcore_mamba.config import MambaConfig


@hookimpl
def kvcore_register_components(register: Callable[..., None]) -> None:
    register("mamba", MambaComponent, options=MambaOptions,
             description="recurrent-state slots: one per node, single-node locks, copy-on-write on match")


@hookimpl
def kvcore_register_backends(register: Callable[..., None]) -> None:
    register(
        "mamba",
        tiered(UnifiedRadixCache, check=require_full_only),
        config=MambaConfig,
        pools=UnifiedPools(),
        description=(
            "Hybrid full-attention + Mamba on the one tree, components (full, mamba): a state pool, state "
            "snapshots per node, tombstones, two LRU orders, copy-on-write states (SGLang UnifiedRadixCache)"
        ),
    )

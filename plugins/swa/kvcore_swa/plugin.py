"""Entry point ``swa`` in group ``kvcore``: the ``swa`` component and the backends ``swa``, ``swa-chunk``,
``swa-pure`` and ``swa-pure-chunk``."""

from __future__ import annotations

from collections.abc import Callable

from kvcore import hookimpl
from kvcore.tiers import tiered
from kvcore.tree.unified import UnifiedRadixCache
from kvcore.tree.unified_config import UnifiedPools, require_full_only
from kvcore_swa.chunk import SWAChunkCache
from kvcore_swa.component import SWAComponent, SWAOptions
from kvcore_swa.config import SWAChunkConfig, SWAConfig, SWAPools
from kvcore_swa.pure import PureSWAChunkCache, PureSWAChunkConfig, PureSWAConfig, PureSWAPools, PureSWARadixCache


@hookimpl
def kvcore_register_components(register: Callable[..., None]) -> None:
    register("swa", SWAComponent, options=SWAOptions,
             description="sliding-window slots: tombstones, window locks, window-only recency")


@hookimpl
def kvcore_register_backends(register: Callable[..., None]) -> None:
    register(
        "swa",
        tiered(UnifiedRadixCache, check=require_full_only),
        config=SWAConfig,
        pools=UnifiedPools(),
        description=(
            "Sliding-window attention on the one tree, components (full, swa): tombstones, "
            "two LRU orders, window-bounded locks (SGLang UnifiedRadixCache)"
        ),
    )
    register(
        "swa-chunk",
        SWAChunkCache,
        config=SWAChunkConfig,
        pools=SWAPools(),
        description="Sliding-window attention without prefix reuse: frees out-of-window slots (SGLang SWAChunkCache)",
    )
    register(
        "swa-pure",
        PureSWARadixCache,
        config=PureSWAConfig,
        pools=PureSWAPools(),
        description=(
            "Every layer sliding-window: the radix tree on one window pool, finished requests cached "
            "below swa_evict_floor (SGLang PureSWARadixCache)"
        ),
    )
    register(
        "swa-pure-chunk",
        PureSWAChunkCache,
        config=PureSWAChunkConfig,
        pools=PureSWAPools(),
        description="Every layer sliding-window, no prefix reuse, one window pool (SGLang PureSWAChunkCache)",
    )

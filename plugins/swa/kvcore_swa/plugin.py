"""Entry point ``swa`` in group ``kvcore``: registers ``swa``, ``swa-chunk``, ``swa-pure`` and ``swa-pure-chunk``."""

from __future__ import annotations

from collections.abc import Callable

from kvcore import hookimpl
from kvcore_swa.chunk import SWAChunkCache
from kvcore_swa.config import SWAChunkConfig, SWAConfig, SWAPools
from kvcore_swa.pure import PureSWAChunkCache, PureSWAChunkConfig, PureSWAConfig, PureSWAPools, PureSWARadixCache
from kvcore_swa.tree import SWARadixCache


@hookimpl
def kvcore_register_backends(register: Callable[..., None]) -> None:
    register(
        "swa",
        SWARadixCache,
        config=SWAConfig,
        pools=SWAPools(),
        description=(
            "Sliding-window attention radix tree on a full + window pool: tombstones, "
            "two LRU orders, window-bounded locks (SGLang SWARadixCache)"
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

"""kvcore-swa: sliding-window-attention backends for kvcore.

``swa``       the core's one tree (:class:`kvcore.tree.unified.UnifiedRadixCache`) with components
              (full, swa): SGLang's UnifiedRadixCache; the ``swa`` component is :class:`SWAComponent`.
``swa-chunk`` :class:`SWAChunkCache`, SGLang's SWAChunkCache.
``swa-pure``  :class:`PureSWARadixCache`, SGLang's PureSWARadixCache (every layer sliding-window).
``swa-pure-chunk`` :class:`PureSWAChunkCache`, SGLang's PureSWAChunkCache.

The tree is kvcore's (:mod:`kvcore.tree`); this distribution contributes the ``swa`` component.
"""

from importlib.metadata import version

from kvcore_swa.chunk import SWAChunkCache
from kvcore_swa.component import SWAComponent, SWAOptions
from kvcore_swa.config import SWAChunkConfig, SWAConfig, min_swa_size
from kvcore_swa.pure import (
    PureSWAChunkCache,
    PureSWAChunkConfig,
    PureSWAConfig,
    PureSWARadixCache,
    PureSWATokenToKVPoolAllocator,
)

__version__ = version("kvcore-swa")

__all__ = [
    "SWAComponent",
    "SWAOptions",
    "SWAChunkCache",
    "SWAConfig",
    "SWAChunkConfig",
    "min_swa_size",
    "PureSWARadixCache",
    "PureSWAChunkCache",
    "PureSWAConfig",
    "PureSWAChunkConfig",
    "PureSWATokenToKVPoolAllocator",
    "__version__",
]

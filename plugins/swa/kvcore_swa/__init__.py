"""kvcore-swa: sliding-window-attention backends for kvcore.

``swa``       :class:`SWARadixCache`, SGLang's SWARadixCache.
``swa-chunk`` :class:`SWAChunkCache`, SGLang's SWAChunkCache.
``swa-pure``  :class:`PureSWARadixCache`, SGLang's PureSWARadixCache (every layer sliding-window).
``swa-pure-chunk`` :class:`PureSWAChunkCache`, SGLang's PureSWAChunkCache.

The tree machinery (nodes, splits, lock walks, LRU lists, KV events) is
kvcore's public tree kit, :mod:`kvcore.tree`.
"""

from importlib.metadata import version

from kvcore_swa.chunk import SWAChunkCache
from kvcore_swa.config import SWAChunkConfig, SWAConfig, min_swa_size
from kvcore_swa.pure import (
    PureSWAChunkCache,
    PureSWAChunkConfig,
    PureSWAConfig,
    PureSWARadixCache,
    PureSWATokenToKVPoolAllocator,
)
from kvcore_swa.tree import SWARadixCache, SWATreeNode

__version__ = version("kvcore-swa")

__all__ = [
    "SWARadixCache",
    "SWATreeNode",
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

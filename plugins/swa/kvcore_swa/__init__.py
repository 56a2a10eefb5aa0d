"""kvcore-swa: sliding-window-attention backends for kvcore.

``swa``       :class:`SWARadixCache`, SGLang's SWARadixCache.
``swa-chunk`` :class:`SWAChunkCache`, SGLang's SWAChunkCache.
"""

from kvcore_swa.chunk import SWAChunkCache
from kvcore_swa.config import SWAChunkConfig, SWAConfig, min_swa_size
from kvcore_swa.tree import SWARadixCache, SWATreeNode

__all__ = ["SWARadixCache", "SWATreeNode", "SWAChunkCache", "SWAConfig", "SWAChunkConfig", "min_swa_size"]
__version__ = "0.1.0"

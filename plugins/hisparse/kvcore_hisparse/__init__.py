"""kvcore-hisparse: host-backed sparse-attention decode for kvcore (backend ``hisparse``).

:class:`HiSparseCache` is the backend; :class:`HiSparseCoordinator` is SGLang 0.5.19's
``HiSparseCoordinator`` (staging, device buffers, top-k swap-in with a per-layer LRU);
:mod:`kvcore_hisparse.memory_pool` holds its three pools.
"""

from importlib.metadata import version

from kvcore_hisparse.cache import HiSparseCache
from kvcore_hisparse.config import HiSparseConfig
from kvcore_hisparse.coordinator import HiSparseCoordinator, HiSparseReqState, HiSparseTokenStats
from kvcore_hisparse.memory_pool import HiSparseHostPool, HiSparseTokenToKVPool, HiSparseTokenToKVPoolAllocator

__version__ = version("kvcore-hisparse")

__all__ = [
    "HiSparseCache",
    "HiSparseConfig",
    "HiSparseCoordinator",
    "HiSparseReqState",
    "HiSparseTokenStats",
    "HiSparseHostPool",
    "HiSparseTokenToKVPool",
    "HiSparseTokenToKVPoolAllocator",
    "__version__",
]

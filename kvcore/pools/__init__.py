"""Device pools: request rows, token-slot allocators and KV data buffers."""

from kvcore.pools.allocator import TokenToKVPoolAllocator
from kvcore.pools.kv_buffer import MHATokenToKVPool
from kvcore.pools.mamba_pool import HybridReqToTokenPool, MambaPool
from kvcore.pools.req_to_token import DecodeReqToTokenPool, ReqToTokenPool
from kvcore.pools.swa_allocator import SWATokenToKVPoolAllocator
from kvcore.pools.views import PageAllocator, PoolView, TokenAllocator

__all__ = [
    "ReqToTokenPool",
    "DecodeReqToTokenPool",
    "TokenToKVPoolAllocator",
    "SWATokenToKVPoolAllocator",
    "MHATokenToKVPool",
    "MambaPool",
    "HybridReqToTokenPool",
    "PoolView",
    "PageAllocator",
    "TokenAllocator",
]

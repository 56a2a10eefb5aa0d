"""Device pools: request rows, token-slot allocators and KV data buffers."""

from kvcore.pools.allocator import TokenToKVPoolAllocator
from kvcore.pools.kv_buffer import MHATokenToKVPool
from kvcore.pools.req_to_token import ReqToTokenPool
from kvcore.pools.swa_allocator import SWATokenToKVPoolAllocator
from kvcore.pools.views import PageAllocator, PoolView, TokenAllocator

__all__ = [
    "ReqToTokenPool",
    "TokenToKVPoolAllocator",
    "SWATokenToKVPoolAllocator",
    "MHATokenToKVPool",
    "PoolView",
    "PageAllocator",
    "TokenAllocator",
]

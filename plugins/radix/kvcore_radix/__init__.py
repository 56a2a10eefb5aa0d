"""kvcore-radix: the ``radix`` prefix-cache backend for kvcore (SGLang RadixCache semantics)."""

from kvcore_radix.events import AllPagesCleared, PageRemoved, PageStored, chain_page_hashes, page_hash
from kvcore_radix.policies import (
    BUILTIN_POLICIES,
    EvictionStrategy,
    FIFOStrategy,
    FILOStrategy,
    LFUStrategy,
    LRUStrategy,
    MRUStrategy,
    PriorityStrategy,
    SLRUStrategy,
    resolve_policy,
)
from kvcore_radix.radix_cache import RadixCache, RadixConfig, TreeNode

__version__ = "0.1.0"

__all__ = [
    "RadixCache",
    "RadixConfig",
    "TreeNode",
    "PageStored",
    "PageRemoved",
    "AllPagesCleared",
    "page_hash",
    "chain_page_hashes",
    "EvictionStrategy",
    "LRUStrategy",
    "LFUStrategy",
    "FIFOStrategy",
    "MRUStrategy",
    "FILOStrategy",
    "PriorityStrategy",
    "SLRUStrategy",
    "BUILTIN_POLICIES",
    "resolve_policy",
]

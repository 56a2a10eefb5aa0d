"""kvcore: the KV-cache bookkeeping layer of an LLM serving engine.

The core holds the ownership record (``ReqKvInfo``), the pools, the release
paths, streaming sessions, the invariant checker and the plugin mechanism;
backends (radix, swa, ...) are separate distributions found through the
``kvcore`` entry-point group.
"""

from importlib.metadata import version as _version

from kvcore.cache import BasePrefixCache, EvictResult, InsertResult, LockResult, MatchResult, SlotOwner
from kvcore.capabilities import Capability
from kvcore.chunk_cache import ChunkCache
from kvcore.config import CacheConfig, CacheInitParams, KvBufferConfig, TreeCacheConfig
from kvcore.engine import Engine
from kvcore.errors import BackendNotFound, DeviceUnavailable, InvariantViolation, KvcoreError, PluginError
from kvcore.factory import ConfigError, create_cache
from kvcore.forwarding import ForwardingCache
from kvcore.hookspecs import hookimpl, hookspec
from kvcore.invariants import InvariantChecker
from kvcore.keys import RadixKey
from kvcore.plugins import available_backends, available_eviction_policies, plugin_failures
from kvcore.pools import (
    DecodeReqToTokenPool,
    MHATokenToKVPool,
    PoolView,
    ReqToTokenPool,
    SWATokenToKVPoolAllocator,
    TokenToKVPoolAllocator,
)
from kvcore.record import Req, ReqKvInfo, RetractionBackup
from kvcore.release import (
    cache_unfinished_req,
    free_swa_out_of_window_slots,
    free_swa_out_of_window_slots_batch,
    release_kv_cache,
)
from kvcore.session import SessionSlot, StreamingSession
from kvcore.stores import KVStore, StoreNamespace, available_stores, open_store

__version__ = _version("kvcore")

__all__ = [
    "ForwardingCache",
    "BackendNotFound",
    "BasePrefixCache",
    "CacheConfig",
    "Capability",
    "CacheInitParams",
    "ChunkCache",
    "ConfigError",
    "DecodeReqToTokenPool",
    "DeviceUnavailable",
    "Engine",
    "EvictResult",
    "InsertResult",
    "InvariantChecker",
    "InvariantViolation",
    "KVStore",
    "KvBufferConfig",
    "KvcoreError",
    "LockResult",
    "MHATokenToKVPool",
    "MatchResult",
    "PluginError",
    "PoolView",
    "RadixKey",
    "Req",
    "ReqKvInfo",
    "ReqToTokenPool",
    "RetractionBackup",
    "SWATokenToKVPoolAllocator",
    "SessionSlot",
    "SlotOwner",
    "StoreNamespace",
    "StreamingSession",
    "TokenToKVPoolAllocator",
    "TreeCacheConfig",
    "available_backends",
    "available_eviction_policies",
    "available_stores",
    "cache_unfinished_req",
    "create_cache",
    "free_swa_out_of_window_slots",
    "free_swa_out_of_window_slots_batch",
    "hookimpl",
    "hookspec",
    "open_store",
    "plugin_failures",
    "release_kv_cache",
]

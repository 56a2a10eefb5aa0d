"""KV stores: where a page's K/V bytes live beyond one engine (an in-process map, a directory, Redis).

A store is opened by URL (``kvcore.open_store("redis://127.0.0.1:6379/0?ttl=600")``);
schemes come from plugins through ``kvcore_register_stores(register)``, the core
registers ``memory://`` and ``file:///dir``.  Every store follows
:class:`KVStore`: batched exists/get/set by string key, reads also as
memoryviews (``batch_get_views``) or into the caller's buffers
(``batch_get_into``), counters in ``stats()``, and the failure rule: a store
that is unreachable, slow (past its ``timeout``), full or returns a value that
fails its length or checksum answers a miss (or ``False``), counted in
``stats()["errors"]``; it never raises into the engine.

Keys come from :class:`StoreNamespace` (model layout, dtype, page size,
``extra_key``) and the chained page hash of :mod:`kvcore.tree.events`.
"""

from kvcore.stores.base import KVStore, StoreStats
from kvcore.stores.file import FileStore
from kvcore.stores.framing import FRAME_OVERHEAD, frame, unframe, unframe_view
from kvcore.stores.keys import StoreNamespace
from kvcore.stores.memory import MemoryStore
from kvcore.stores.registry import (
    StoreConfigError,
    StoreNotFound,
    StoreSpec,
    StoreURL,
    available_stores,
    open_store,
    reset_stores,
)

__all__ = [
    "FRAME_OVERHEAD",
    "FileStore",
    "MemoryStore",
    "KVStore",
    "StoreConfigError",
    "StoreNamespace",
    "StoreNotFound",
    "StoreSpec",
    "StoreStats",
    "StoreURL",
    "available_stores",
    "frame",
    "open_store",
    "reset_stores",
    "unframe",
    "unframe_view",
]

"""The core's own stores, registered through the same hook plugins use."""

from collections.abc import Callable

from kvcore.hookspecs import hookimpl
from kvcore.stores.file import FileStore
from kvcore.stores.memory import MemoryStore


@hookimpl
def kvcore_register_stores(register: Callable[..., None]) -> None:
    register("memory", MemoryStore.from_url,
             description="In-process store (memory://[name]?max_bytes=N&ttl=S), LRU-bounded; a name is shared")
    register("file", FileStore.from_url, description="One file per key under a directory (file:///dir?ttl=S)")

"""The core's own plugin: the ``chunk`` backend, the ``full`` tree component and the tree eviction policies.

They register through the same hooks third-party plugins use, so
``kvcore backends`` lists them with their distribution like any other.
"""

from collections.abc import Callable

from kvcore.chunk_cache import ChunkCache
from kvcore.config import CacheConfig
from kvcore.hookspecs import hookimpl
from kvcore.tree.full import FullComponent
from kvcore.tree.policies import BUILTIN_POLICIES


@hookimpl
def kvcore_register_backends(register: Callable[..., None]) -> None:
    register(
        "chunk",
        ChunkCache,
        config=CacheConfig,
        description="No prefix reuse: KV lives and dies with each request (SGLang ChunkCache)",
    )


@hookimpl
def kvcore_register_eviction_policies(register: Callable[..., None]) -> None:
    for name, factory in BUILTIN_POLICIES.items():
        register(name, factory)


@hookimpl
def kvcore_register_components(register: Callable[..., None]) -> None:
    register("full", FullComponent, description="full-attention KV slots: path locks, leaf eviction by recency")

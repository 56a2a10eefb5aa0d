"""Registers the built-in backend through the same hook third-party plugins use."""

from kvcore.chunk_cache import ChunkCache
from kvcore.config import CacheConfig
from kvcore.hookspecs import hookimpl


@hookimpl
def kvcore_register_backends(register):
    register("chunk", ChunkCache, config=CacheConfig, description="No prefix reuse: KV lives and dies with each request (SGLang ChunkCache)")

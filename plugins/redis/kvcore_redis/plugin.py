"""Entry point of kvcore-redis (group ``kvcore``): the ``redis`` and ``redis+cluster`` stores."""

from collections.abc import Callable

from kvcore import hookimpl
from kvcore_redis.store import RedisClusterStore, RedisStore


@hookimpl
def kvcore_register_stores(register: Callable[..., None]) -> None:
    register("redis", RedisStore.from_url,
             description="One Redis server (redis://host:port/db?timeout=S&ttl=S), pipelined batches")
    register("redis+cluster", RedisClusterStore.from_url,
             description="Redis Cluster (redis+cluster://host:port[,host:port...]), one pipeline per node; "
             "a node that fails misses only its keys")

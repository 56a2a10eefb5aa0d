"""kvcore-redis: KV stores on Redis (``redis://host:port/db``) and Redis Cluster (``redis+cluster://h:p,...``)."""

from kvcore_redis.config import RedisOptions
from kvcore_redis.store import RedisClusterStore, RedisStore

__all__ = ["RedisOptions", "RedisStore", "RedisClusterStore"]

"""Real redis-server processes on 127.0.0.1 (:mod:`kvcore_redis.fixtures`, shared with kvcore-sglang's tests).

Nothing is stubbed: the tests need Debian's ``redis-server`` and ``redis-cli``
(``.ci/run`` installs them); without them every test here is skipped with that reason.
"""

from kvcore_redis.fixtures import own_server, redis_cluster, redis_server

__all__ = ["own_server", "redis_cluster", "redis_server"]

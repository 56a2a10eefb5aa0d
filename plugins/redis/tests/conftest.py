"""Real redis-server processes on 127.0.0.1, free ports, data under pytest's tmp, stopped at the end.

Nothing is stubbed: the tests need Debian's ``redis-server`` and ``redis-cli``
(``.ci/run`` installs them); without them every test here is skipped with that reason.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kvcore_redis.servers import RedisClusterServers, RedisServer, redis_server_missing


def _need_redis() -> None:
    why = redis_server_missing()
    if why:
        pytest.skip(why)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory) -> Iterator[RedisServer]:
    """One server for the whole session (tests use their own keys; a test that kills it restarts it)."""
    _need_redis()
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory) -> Iterator[RedisClusterServers]:
    """A three-master Cluster for the whole session (made with ``redis-cli --cluster create``)."""
    _need_redis()
    cluster = RedisClusterServers(tmp_path_factory.mktemp("redis-cluster"), masters=3)
    cluster.start()
    yield cluster
    cluster.stop()


@pytest.fixture
def own_server(tmp_path) -> Iterator[RedisServer]:
    """A server of this test's own, for faults that would disturb the others (maxmemory, kills)."""
    _need_redis()
    server = RedisServer(tmp_path / "redis")
    yield server
    server.stop()

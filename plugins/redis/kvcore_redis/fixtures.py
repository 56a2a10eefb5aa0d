"""pytest fixtures of real redis-server processes on 127.0.0.1: free ports, data under pytest's tmp, stopped at the end.

Any test suite may use them: import the fixtures it needs into its ``conftest.py``
(``from kvcore_redis.fixtures import redis_server``).  They need Debian's
``redis-server`` and ``redis-cli`` (``.ci/run`` installs them); without them a test
that asks for one is skipped with that reason.  Nothing is stubbed.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcore_redis.servers import RedisClusterServers, RedisServer, redis_server_missing

__all__ = ["own_server", "redis_cluster", "redis_server"]


def _need_redis() -> None:
    why = redis_server_missing()
    if why:
        pytest.skip(why)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One server for the whole session (tests use their own keys; a test that kills it restarts it)."""
    _need_redis()
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterServers]:
    """A three-master Cluster for the whole session (made with ``redis-cli --cluster create``)."""
    _need_redis()
    cluster = RedisClusterServers(tmp_path_factory.mktemp("redis-cluster"), masters=3)
    cluster.start()
    yield cluster
    cluster.stop()


@pytest.fixture
def own_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A server of this test's own, for faults that would disturb the others (maxmemory, kills)."""
    _need_redis()
    server = RedisServer(tmp_path / "redis")
    yield server
    server.stop()

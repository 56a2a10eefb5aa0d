"""kvcore's store kit against a real redis-server and a real three-master Redis Cluster."""

from __future__ import annotations

import pytest

from kvcore.testing.stores import StoreConformance


class TestRedisStore(StoreConformance):
    can_go_away = True

    @pytest.fixture
    def store_url(self, redis_server) -> str:
        self.server = redis_server
        # backoff=0: the kit checks the store answers again as soon as the server is back.
        return f"redis://{redis_server.address}/0?timeout=0.5&backoff=0"

    def break_store(self, store):
        self.server.kill()

    def restore_store(self, store):
        self.server.start()


class TestRedisClusterStore(StoreConformance):
    can_go_away = True

    @pytest.fixture
    def store_url(self, redis_cluster) -> str:
        self.cluster = redis_cluster
        return redis_cluster.url + "?timeout=0.5&backoff=0"

    def break_store(self, store):
        for node in self.cluster.nodes:
            node.kill()

    def restore_store(self, store):
        for node in self.cluster.nodes:
            node.start()
        self.cluster.wait_ok()

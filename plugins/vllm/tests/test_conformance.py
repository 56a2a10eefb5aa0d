"""kvcore-vllm's manager (vLLM's ``OffloadingManager`` over kvcore's books) passes kvcore's offload-tier kit.

The manager is built as ``KvcoreOffloadingSpec.get_manager`` builds it, on a host
region file under the test's tmp dir and a real ``memory://`` store; the adapter
speaks vLLM's calls (``LookupResult``, ``ReqContext``, ``on_schedule_end``).
A second run puts the store on a real ``redis-server`` and kills it.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import pytest
from kvcore_redis.servers import RedisServer
from kvcore_vllm.books import HostBooks
from kvcore_vllm.manager import KvcoreOffloadingManager
from kvcore_vllm.region import HostRegion
from vllm.v1.kv_offload.base import LookupResult, OffloadKey, ReqContext, ScheduleEndContext

from kvcore import InvariantChecker
from kvcore.stores import KVStore, StoreNamespace, open_store
from kvcore.testing.offload_kit import LookupAnswer, OffloadManagerConformance

ROW = 256
_ANSWER: dict[LookupResult, LookupAnswer] = {LookupResult.HIT: "hit", LookupResult.HIT_PENDING: "pending",
                                             LookupResult.RETRY: "retry", LookupResult.MISS: "miss"}


class VllmManagerDriver:
    has_store = True

    def __init__(self, capacity: int, tmp_path: Path, store_url: str, server: RedisServer | None = None) -> None:
        self.capacity = capacity
        self.server = server
        self.ns = StoreNamespace("kit", "float32", 32).prefix(None)
        self.books = HostBooks(capacity, "lru")
        self.store: KVStore = open_store(store_url)
        self.writer: KVStore = open_store(store_url)
        self.manager = KvcoreOffloadingManager(
            self.books, lambda: HostRegion(tmp_path / "host.region", capacity + 1, ROW), self.store, self.key)
        self.ctx = ReqContext(req_id="kit-0")
        self.manager.on_new_request(self.ctx)
        self.rng = random.Random(0)

    def key(self, k: bytes) -> str:
        return self.ns + k.hex()

    def lookup(self, keys: Sequence[bytes]) -> list[LookupAnswer]:
        return [_ANSWER[self.manager.lookup(OffloadKey(k), self.ctx)] for k in keys]

    def settle(self) -> None:
        end = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
        self.manager.on_schedule_end(end)
        for f in list(self.manager._fetches):
            f.future.result(timeout=30)
        self.manager.on_schedule_end(end)
        assert not self.manager.has_pending_work()

    def prepare_store(self, keys: Sequence[bytes]) -> tuple[list[bytes], list[bytes]] | None:
        out = self.manager.prepare_store([OffloadKey(k) for k in keys], self.ctx)
        return None if out is None else (list(out.keys_to_store), list(out.evicted_keys))

    def complete_store(self, keys: Sequence[bytes], success: bool = True) -> None:
        self.manager.complete_store([OffloadKey(k) for k in keys], self.ctx, success)

    def prepare_load(self, keys: Sequence[bytes]) -> None:
        self.manager.prepare_load([OffloadKey(k) for k in keys], self.ctx)

    def complete_load(self, keys: Sequence[bytes]) -> None:
        self.manager.complete_load([OffloadKey(k) for k in keys], self.ctx)

    def write_store(self, keys: Sequence[bytes]) -> None:
        assert all(self.writer.batch_set([self.key(k) for k in keys],
                                         [self.rng.randbytes(ROW) for _ in keys]))

    def corrupt_store(self, keys: Sequence[bytes]) -> None:
        for k in keys:
            self.writer.corrupt(self.key(k), self.rng.randbytes(ROW + 16))  # type: ignore[attr-defined]

    def break_store(self) -> None:
        if self.server is not None:
            self.server.kill()
        else:
            self.store.close()

    def store_round_trips(self) -> int:
        return self.store.stats()["round_trips"]

    def check(self) -> None:
        InvariantChecker(self.books).check()  # type: ignore[arg-type]

    def close(self) -> None:
        self.manager.shutdown()
        self.writer.close()
        if self.server is not None and self.server.proc is None:
            self.server.start()


class TestManagerOnMemoryStore(OffloadManagerConformance):
    def make_driver(self, capacity: int, tmp_path: Path) -> VllmManagerDriver:
        return VllmManagerDriver(capacity, tmp_path, f"memory://kit-{tmp_path.name}")


class TestManagerOnRedis(OffloadManagerConformance):
    @pytest.fixture(autouse=True)
    def _server(self, redis_server: RedisServer) -> None:
        self.server = redis_server

    def make_driver(self, capacity: int, tmp_path: Path) -> VllmManagerDriver:
        with self.server.client() as c:
            c.flushall()
        return VllmManagerDriver(capacity, tmp_path, f"redis://{self.server.address}/0?timeout=0.2", self.server)


def test_events_name_blocks_stored_and_evicted_when_vllm_asks_for_them(tmp_path: Path) -> None:
    from kvcore.testing.offload_kit import block_keys

    books = HostBooks(2, "lru", events=True)
    m = KvcoreOffloadingManager(books, lambda: HostRegion(tmp_path / "r", 3, ROW), None, str, enable_events=True)
    ctx = ReqContext(req_id="events")
    a, b, c = (OffloadKey(k) for k in block_keys(3, "ev"))
    for key in (a, b, c):
        out = m.prepare_store([key], ctx)
        assert out is not None
        m.complete_store(out.keys_to_store, ctx)
    events = [(e.removed, list(e.keys)) for e in m.take_events()]
    assert events == [(False, [a]), (False, [b]), (True, [a]), (False, [c])]
    assert list(m.take_events()) == []
    InvariantChecker(books).check()  # type: ignore[arg-type]
    m.shutdown()

    quiet = HostBooks(2, "lru", events=False)
    m = KvcoreOffloadingManager(quiet, lambda: HostRegion(tmp_path / "q", 3, ROW), None, str)
    out = m.prepare_store([a], ctx)
    assert out is not None
    m.complete_store([a], ctx)
    assert quiet.take_events() == [], "no events pile up when vLLM does not drain them"
    m.shutdown()

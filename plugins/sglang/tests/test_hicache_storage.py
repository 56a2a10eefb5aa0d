"""kvcore's stores as SGLang 0.5.19's HiCache L3 backend, driven through SGLang's own storage code on the CPU.

The backend is built by SGLang's ``StorageBackendFactory`` from the ``dynamic``
extra config, its host pool is SGLang's ``MHATokenToKVPoolHost``, and pages move
through ``HiCacheController``'s own page get/set functions (zero-copy v1 and the
legacy flat-page path), with memory, file, a real redis-server and a real
three-master Redis Cluster underneath.  Nothing is stubbed but the controller's
``self`` (the functions read three of its attributes).
"""

from __future__ import annotations

import json
import re
import threading
from types import SimpleNamespace

import pytest
import torch
from kvcore_sglang.hicache_storage import STORE_URL_ENV, KvcoreHiCacheStorage
from kvcore_sglang.plugin import HICACHE_BACKEND, hicache_extra_config
from sglang.srt.managers.cache_controller import HiCacheController
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

import kvcore

pytest.importorskip("kvcore_redis")
from kvcore_redis.fixtures import redis_cluster, redis_server  # noqa: E402,F401  (fixtures used by name)


@pytest.fixture
def server(request):
    """kvcore-redis's session redis-server."""
    return request.getfixturevalue("redis_server")


@pytest.fixture
def cluster(request):
    """kvcore-redis's session three-master Cluster."""
    return request.getfixturevalue("redis_cluster")

PS = 4
PAGES = 6


def host_pool(layout: str = "page_first") -> MHATokenToKVPoolHost:
    device = MHATokenToKVPool(64, PS, torch.float16, head_num=2, head_dim=8, layer_num=2, device="cpu",
                              enable_memory_saver=False)
    return MHATokenToKVPoolHost(device, 4.0, 0, PS, layout, pin_memory=False, device="cpu")


def storage_config(url: str | None, model: str = "org/model", tp_rank: int = 0, tp_size: int = 1,
                   **extra: object) -> HiCacheStorageConfig:
    extra_config = json.loads(hicache_extra_config(url, **extra)) if url is not None else dict(HICACHE_BACKEND)
    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                attn_cp_size=1, is_mla_model=False, enable_storage_metrics=False,
                                is_page_first_layout=True, model_name=model, extra_config=extra_config)


def attach(url: str | None, pool: MHATokenToKVPoolHost, **kw: object) -> KvcoreHiCacheStorage:
    """What ``HiCacheController.attach_storage_backend`` does: the factory, then the host pool."""
    backend = StorageBackendFactory.create_backend("dynamic", storage_config(url, **kw), pool)
    backend.register_mem_pool_host(pool)
    return backend


def controller(backend: HiCacheStorage, pool: MHATokenToKVPoolHost) -> SimpleNamespace:
    """The three attributes of a ``HiCacheController`` its page get/set functions read."""
    return SimpleNamespace(storage_backend=backend, storage_host_pool=pool, page_size=PS)


OP = SimpleNamespace(request_id="req", is_terminated=lambda: False)


def fill(pool: MHATokenToKVPoolHost, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=gen).to(pool.kv_buffer.dtype))


def pages(pool: MHATokenToKVPoolHost, first: int, n: int = PAGES) -> list[bytes]:
    return [pool.get_data_page((first + i) * PS, flat=True).contiguous().view(torch.uint8).numpy().tobytes()
            for i in range(n)]


def hashes(tag: str, n: int = PAGES) -> list[str]:
    return [f"{tag}-{i:04d}" for i in range(n)]


SRC = torch.arange(0, PAGES * PS, dtype=torch.int64)
DST = torch.arange(PAGES * PS, 2 * PAGES * PS, dtype=torch.int64)


def round_trip_v1(url: str, tag: str) -> KvcoreHiCacheStorage:
    pool = host_pool()
    fill(pool)
    backend = attach(url, pool)
    ctrl = controller(backend, pool)
    keys = hashes(tag)
    assert HiCacheController._page_set_zero_copy(ctrl, keys, SRC) is True
    assert backend.batch_exists(keys) == PAGES
    assert HiCacheController._page_get_zero_copy(ctrl, OP, keys, DST) == PAGES
    assert pages(pool, PAGES) == pages(pool, 0)
    return backend


@pytest.fixture
def store_url(request, tmp_path) -> str:
    kind = request.param
    if kind == "memory":
        return "memory://hicache-" + re.sub(r"\W", "-", request.node.name)
    if kind == "file":
        return f"file://{tmp_path / 'store'}"
    if kind == "redis":
        return f"redis://{request.getfixturevalue('redis_server').address}/0?timeout=0.5&backoff=0"
    return request.getfixturevalue("redis_cluster").url + "?timeout=0.5&backoff=0"


ALL_STORES = ["memory", "file", "redis", "redis+cluster"]


def test_sglang_factory_builds_it_from_the_dynamic_extra_config():
    backend = attach("memory://factory", host_pool())
    assert isinstance(backend, HiCacheStorage) and isinstance(backend, KvcoreHiCacheStorage)
    assert backend.namespace().startswith("kvcore:sglang:")
    # SGLang picks the zero-copy functions for a dynamic backend with interface_v1 set.
    assert HICACHE_BACKEND["interface_v1"] == 1


@pytest.mark.parametrize("store_url", ALL_STORES, indirect=True)
def test_v1_pages_round_trip_byte_identical(store_url):
    backend = round_trip_v1(store_url, "v1")
    stats = backend.stats()
    assert stats["errors"] == 0 and stats["hits"] == PAGES
    backend.close()


@pytest.mark.parametrize("store_url", ["memory", "redis"], indirect=True)
def test_legacy_flat_pages_round_trip_byte_identical(store_url):
    pool = host_pool("layer_first")
    fill(pool, seed=3)
    backend = attach(store_url, pool)
    ctrl = controller(backend, pool)
    keys = hashes("legacy")
    assert HiCacheController._generic_page_set(ctrl, keys, SRC) is True
    assert all(backend.exists(k) for k in keys)
    assert HiCacheController._generic_page_get(ctrl, OP, keys, DST) == PAGES
    assert pages(pool, PAGES) == pages(pool, 0)
    one = backend.get(keys[0], pool.get_dummy_flat_data_page())
    assert one is not None and one.view(torch.uint8).numpy().tobytes() == pages(pool, 0, 1)[0]
    assert backend.set("single", pool.get_data_page(0)) and backend.exists("single")


def test_exists_counts_the_contiguous_prefix_and_get_stops_at_a_miss():
    pool = host_pool()
    fill(pool)
    backend = attach("memory://prefix", pool)
    keys = hashes("gap")
    assert backend.batch_set_v1([keys[0], keys[1], keys[3]], torch.cat([SRC[: 2 * PS], SRC[3 * PS: 4 * PS]]))
    assert backend.batch_exists(keys[:4]) == 2
    assert backend.batch_get_v1(keys[:4], DST[: 4 * PS]) == [True, True, False, True]
    assert HiCacheController._page_get_zero_copy(controller(backend, pool), OP, keys[:4], DST[: 4 * PS]) == 2


def test_namespaces_keep_models_ranks_and_layouts_apart():
    url = "memory://namespaces"
    round_trip_v1(url, "ns")
    for other in (attach(url, host_pool(), model="other/model"), attach(url, host_pool(), tp_rank=1, tp_size=2),
                  attach(url, host_pool("layer_first"))):
        assert other.batch_exists(hashes("ns")) == 0
    assert attach(url, host_pool()).batch_exists(hashes("ns")) == PAGES  # same model, rank and layout


def test_a_value_of_another_page_size_or_corrupted_bytes_is_a_miss(server):
    url = f"redis://{server.address}/0?timeout=0.5&backoff=0"
    backend = round_trip_v1(url, "bad")
    keys = [backend.namespace() + k for k in hashes("bad")]
    backend.store.batch_set([keys[0]], [b"short"])  # a page of another layout
    backend.store.corrupt(keys[1], b"garbage that is no kvcore frame")
    assert backend.batch_get_v1(hashes("bad")[:3], DST[: 3 * PS]) == [False, False, True]
    assert backend.batch_get(hashes("bad")[:2]) == [None, None]


def test_a_store_that_is_gone_answers_misses_and_never_raises(server):
    pool = host_pool()
    fill(pool)
    backend = attach(f"redis://{server.address}/0?timeout=0.3&backoff=0", pool)
    ctrl = controller(backend, pool)
    keys = hashes("gone")
    assert HiCacheController._page_set_zero_copy(ctrl, keys, SRC)
    server.kill()
    try:
        assert backend.batch_exists(keys) == 0
        assert backend.batch_get_v1(keys, DST) == [False] * PAGES
        assert backend.batch_set_v1(keys, SRC) == [False] * PAGES
        assert HiCacheController._page_get_zero_copy(ctrl, OP, keys, DST) == 0
        assert HiCacheController._generic_page_get(ctrl, OP, keys, DST) == 0
        assert HiCacheController._generic_page_set(ctrl, keys, SRC) is False
        assert backend.get(keys[0]) is None and backend.exists(keys[0]) is False
        assert backend.set(keys[0], pool.get_data_page(0)) is False
        assert backend.clear() is False
        assert backend.stats()["errors"] > 0
    finally:
        server.start()
    assert HiCacheController._page_set_zero_copy(ctrl, keys, SRC)  # the server is back (empty): writes again
    assert HiCacheController._page_get_zero_copy(ctrl, OP, keys, DST) == PAGES
    assert pages(pool, PAGES) == pages(pool, 0)


def test_bad_inputs_from_a_caller_are_misses_too():
    pool = host_pool()
    backend = attach("memory://inputs", pool)
    assert backend.batch_get_v1(["a", "b"], torch.arange(PS)) == [False, False]  # too few host indices
    assert backend.batch_set(["a"], [pool.get_data_page(0), pool.get_data_page(4)]) is False
    assert backend.batch_get([]) == [] and backend.batch_exists([]) == 0
    unregistered = StorageBackendFactory.create_backend("dynamic", storage_config("memory://inputs"), pool)
    assert unregistered.batch_exists(["a"]) == 0 and unregistered.batch_set_v1(["a"], SRC[:PS]) == [False]


def test_backup_and_prefetch_threads_at_once(cluster):
    pool = host_pool()
    fill(pool, seed=9)
    backend = attach(cluster.url + "?timeout=1", pool)
    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            keys = hashes(f"thread{t}")
            for _ in range(5):
                assert backend.batch_set_v1(keys, SRC) == [True] * PAGES
                assert backend.batch_exists(keys) == PAGES
        except BaseException as exc:  # reported below: an assertion in a thread would be lost
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    assert backend.stats()["errors"] == 0


def test_a_bad_configuration_is_refused_when_sglang_builds_it(monkeypatch):
    monkeypatch.delenv(STORE_URL_ENV, raising=False)
    with pytest.raises(ValueError, match="needs a store URL"):
        StorageBackendFactory.create_backend("dynamic", storage_config(None), host_pool())
    with pytest.raises(kvcore.stores.StoreNotFound, match="gopher"):
        StorageBackendFactory.create_backend("dynamic", storage_config("gopher://x"), host_pool())
    monkeypatch.setenv(STORE_URL_ENV, "memory://from-env")
    assert StorageBackendFactory.create_backend("dynamic", storage_config(None), host_pool()).store.url == \
        "memory://from-env"

"""Config is plain data; create_cache resolves the device and builds pools with the backend's PoolBuilder;
an author's options are strict like kvcore's own."""

from __future__ import annotations

import pytest
import torch
from pydantic import Field, ValidationError

import kvcore
from kvcore.factory import build_pools, resolve_placement
from kvcore.plugins import BACKENDS, get_plugin_manager, registry
from kvcore.pool_builder import Placement, PoolBuilder
from kvcore.pools import TokenToKVPoolAllocator


class FanoutConfig(kvcore.TreeCacheConfig):
    """An author's options: plain annotations, strict through kvcore.CacheConfig."""

    fanout: int = Field(4, gt=0, description="children per node")
    ratio: float = 0.5
    label: str = "x"


BUILT: list[str] = []


class RecordingPools(PoolBuilder[FanoutConfig]):
    def allocator(self, config: FanoutConfig, at: Placement) -> TokenToKVPoolAllocator:
        BUILT.append(f"allocator on {at.torch_device} for fanout {config.fanout}")
        return TokenToKVPoolAllocator(config.size, page_size=config.page_size, device=at.torch_device)


class _FanoutPlugin:
    @kvcore.hookimpl
    def kvcore_register_backends(self, register):
        register("fanout-test", kvcore.ChunkCache, config=FanoutConfig, pools=RecordingPools())


class _BadPoolsPlugin:
    @kvcore.hookimpl
    def kvcore_register_backends(self, register):
        register("bad-pools", kvcore.ChunkCache, pools="mine")


@pytest.fixture
def fanout_backend():
    pm = get_plugin_manager()
    pm.register(_FanoutPlugin(), name="fanout-plugin")
    BACKENDS.reset()
    try:
        yield
    finally:
        pm.unregister(name="fanout-plugin")
        BACKENDS.reset()


@pytest.mark.parametrize("bad", [True, "4", 4.0])
def test_an_authors_int_field_is_strict(bad):
    with pytest.raises(ValidationError, match="fanout\n  Input should be a valid integer"):
        FanoutConfig(fanout=bad)
    assert FanoutConfig(fanout=8).fanout == 8 and FanoutConfig(ratio=1).ratio == 1.0  # an int is a float
    with pytest.raises(ValidationError, match="label"):
        FanoutConfig(label=3)


def test_strict_options_through_create_cache(fanout_backend):
    with pytest.raises(kvcore.ConfigError, match=r"backend 'fanout-test': option 'fanout': Input should be a valid "
                                                 r"integer \(got True\)"):
        kvcore.create_cache("fanout-test", fanout=True)
    with pytest.raises(kvcore.ConfigError, match=r"option 'fanout': Input should be a valid integer \(got '4'\)"):
        kvcore.create_cache("fanout-test", fanout="4")


def test_validating_a_config_touches_no_registry(monkeypatch):
    """A config validates without the plugin registry (it used to look up the device inside a validator)."""

    def no_registry(kind):
        raise AssertionError(f"the registry was asked for {kind!r} while validating")

    monkeypatch.setattr(registry, "collected", no_registry)
    config = kvcore.CacheConfig(size=64, device="quantum")  # unknown devices are create_cache's error
    assert config.device == "quantum" and config.page_size == 1
    assert FanoutConfig(size=64, fanout=2).fanout == 2


def test_the_factory_resolves_the_device_and_builds_with_the_registered_builder(fanout_backend):
    BUILT.clear()
    cache = kvcore.create_cache("fanout-test", size=64, max_num_reqs=2, max_context_len=16, fanout=3)
    assert BUILT == ["allocator on cpu for fanout 3"]
    assert isinstance(cache, kvcore.BasePrefixCache) and cache.page_size == 1
    with pytest.raises(kvcore.DeviceUnavailable, match="unknown device 'quantum'"):
        kvcore.create_cache("fanout-test", device="quantum")
    assert BUILT == ["allocator on cpu for fanout 3"]  # refused before any pool was built
    kvcore.InvariantChecker(cache).check([])


def test_build_pools_and_placement():
    params = build_pools("chunk", kvcore.CacheConfig(size=64, max_num_reqs=2, max_context_len=16))
    assert isinstance(params, kvcore.CacheInitParams) and params.kv_pool is None
    assert isinstance(params.token_to_kv_pool_allocator, TokenToKVPoolAllocator)
    at = resolve_placement("cpu")
    assert at.device.name == "cpu" and at.torch_device == torch.device("cpu")
    cache = kvcore.ChunkCache(params)
    kvcore.InvariantChecker(cache).check([])


def test_a_pools_argument_that_is_not_a_builder_is_refused():
    pm = get_plugin_manager()
    pm.register(_BadPoolsPlugin(), name="bad-pools-plugin")
    BACKENDS.reset()
    try:
        assert "bad-pools" not in BACKENDS.all()
        (failure,) = [f for f in BACKENDS.failures() if f.plugin == "bad-pools-plugin"]
        assert "pools must be a kvcore.pool_builder.PoolBuilder, got 'mine'" in failure.error
    finally:
        pm.unregister(name="bad-pools-plugin")
        BACKENDS.reset()


def test_npu_backend_runs_npu_pools_on_the_cpu():
    pytest.importorskip("kvcore_npu")
    cache = kvcore.create_cache("npu", size=1024, max_num_reqs=2, max_context_len=256)
    assert type(cache.token_to_kv_pool_allocator).__name__ == "NPUPagedTokenToKVPoolAllocator"
    assert cache.session_page_aligned is True and cache.page_size == 128
    kvcore.InvariantChecker(cache).check([])

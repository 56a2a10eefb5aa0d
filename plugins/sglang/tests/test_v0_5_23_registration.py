"""kvcore-sglang on SGLang 0.5.23: the contract module, what SGLang's registry builds, what is refused."""

from __future__ import annotations

import logging

import pytest
import torch
from kvcore_sglang import plugin
from kvcore_sglang.v0_5_23 import KvcoreChunkCache, KvcoreTreeCache, KvcoreUnifiedTreeCache, UnsupportedContext
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.mem_cache.registry import TreeCacheBuildContext, create_tree_cache
from sglang.srt.plugins import load_plugins
from sglang.srt.runtime_context import get_context

import kvcore


def _build(name: str, *, hybrid_swa: bool = False, hybrid_ssm: bool = False, **params: object) -> object:
    r2t = ReqToTokenPool(4, 64, "cpu", False)
    alloc = TokenToKVPoolAllocator(64, torch.float16, "cpu", None, False)
    init = CacheInitParams(disable=False, req_to_token_pool=r2t, token_to_kv_pool_allocator=alloc, page_size=1,
                           **params)
    load_plugins()
    with get_context().override_server_args(radix_cache_backend=name) as server_args:
        return create_tree_cache(TreeCacheBuildContext(
            server_args=server_args, params=init, is_hybrid_swa=hybrid_swa, is_hybrid_ssm=hybrid_ssm,
            enable_hierarchical_cache=False, disable_radix_cache=False, tp_worker=None, model_config=None,
            tp_size=1, tp_rank=0, tp_group=None,
        ))


def test_contract_module_is_v0_5_23() -> None:
    assert plugin.contract_module().__name__ == "kvcore_sglang.v0_5_23"


def test_registry_builds_kvcore_radix_and_logs_it(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO):
        cache = _build("kvcore-radix")
    assert isinstance(cache, KvcoreTreeCache) and cache.supports_prefix_sharing()
    assert cache.kvcore_cache.backend_name == "radix"
    assert "source=registered('kvcore-radix')" in caplog.text
    kvcore.InvariantChecker(cache.kvcore_cache).check()


def test_registry_builds_kvcore_chunk() -> None:
    cache = _build("kvcore-chunk")
    assert isinstance(cache, KvcoreChunkCache) and not cache.supports_prefix_sharing()


def test_registry_builds_kvcore_unified_with_component_full() -> None:
    cache = _build("kvcore-unified")
    assert isinstance(cache, KvcoreUnifiedTreeCache) and cache.supports_prefix_sharing()
    assert cache.kvcore_cache.backend_name == "unified"
    assert tuple(c.name for c in cache.kvcore_cache.components) == ("full",)
    # SGLang 0.5.23's UnifiedRadixCache answers (full tokens, tokens of the other components).
    assert cache.total_size() == (0, 0)
    kvcore.InvariantChecker(cache.kvcore_cache).check()


@pytest.mark.parametrize(("name", "components"), [("kvcore-swa", "full \\+ swa"), ("kvcore-mamba", "full \\+ mamba")])
def test_names_not_served_on_0_5_23_are_refused_by_name(name: str, components: str) -> None:
    # The hybrid models' component sets of kvcore's one tree: no kvcore name serves them on 0.5.23.
    with pytest.raises(UnsupportedContext, match=rf"--radix-cache-backend {name} \(SGLang 0\.5\.23\): {name} is "
                       rf"kvcore's one tree with components {components} \(SGLang's UnifiedRadixCache\), .* yet "
                       rf"\(leave --radix-cache-backend unset for SGLang's own tree\)"):
        _build(name, hybrid_swa=name == "kvcore-swa", hybrid_ssm=name == "kvcore-mamba")


@pytest.mark.parametrize(("kind", "components"), [("swa", "full \\+ swa"), ("ssm", "full \\+ mamba")])
def test_kvcore_unified_refuses_hybrid_models_on_0_5_23(kind: str, components: str) -> None:
    with pytest.raises(UnsupportedContext, match=rf"--radix-cache-backend kvcore-unified \(SGLang 0\.5\.23\): "
                       rf".*UnifiedRadixCache with components {components}.*hybrid-{kind} model"):
        _build("kvcore-unified", hybrid_swa=kind == "swa", hybrid_ssm=kind == "ssm")


def test_kvcore_unified_refuses_eviction_policies_it_does_not_keep() -> None:
    # kvcore's unified tree keeps one LRU order per component; SGLang's unified tree takes other policies.
    with pytest.raises(UnsupportedContext, match="kvcore-unified.*refuses SGLang's options"):
        _build("kvcore-unified", eviction_policy="lfu")


@pytest.mark.parametrize("name", ["kvcore-radix", "kvcore-chunk"])
def test_hybrid_models_are_refused(name: str) -> None:
    with pytest.raises(UnsupportedContext, match="hybrid-swa model, which .* does not serve"):
        _build(name, hybrid_swa=True)


@pytest.mark.parametrize(("option", "value", "words"), [
    ("is_eagle", True, "EAGLE"),
    ("eviction_policy_config", {"x": 1}, "eviction_policy_config"),
    ("draft_swa_window", 4, "draft"),
    ("eviction_policy", "tlru", "refuses SGLang's options"),
])
def test_options_kvcore_does_not_serve_are_refused(option: str, value: object, words: str) -> None:
    with pytest.raises(UnsupportedContext, match=words):
        _build("kvcore-radix", **{option: value})

"""kvcore-sglang inside real SGLang 0.5.19: the entry point, the registry, create_tree_cache and the refusals.

Nothing is stubbed here: the SGLang objects are SGLang's own, built on the CPU.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from array import array

import pytest
import torch
from kvcore_sglang import TARGETS
from kvcore_sglang.plugin import KvcoreFactory, register_with_sglang
from kvcore_sglang.v0_5_19 import KvcoreTreeCache, UnsupportedContext, owner_of
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.registry import (
    TreeCacheBuildContext,
    create_tree_cache,
    get_radix_cache_factory,
    registered_radix_cache_backends,
)
from sglang.srt.plugins import load_plugins
from sglang.srt.runtime_context import get_context

import kvcore

NAMES = [t.name for t in TARGETS]


def make_ctx(server_args, *, page_size=1, size=64, hybrid_ssm=False, hybrid_swa=False, hicache=False, **params):
    r2t = ReqToTokenPool(4, 32, "cpu", False)
    alloc = TokenToKVPoolAllocator(size, torch.float16, "cpu", None, False)
    init = CacheInitParams(disable=False, req_to_token_pool=r2t, token_to_kv_pool_allocator=alloc,
                           page_size=page_size, **params)
    return TreeCacheBuildContext(
        server_args=server_args, params=init, is_hybrid_swa=hybrid_swa, is_hybrid_ssm=hybrid_ssm,
        enable_hierarchical_cache=hicache, disable_radix_cache=False, effective_chunked_prefill_size=None,
        tp_worker=None, model_config=None, tp_size=1, tp_rank=0, tp_group=None,
    )


def test_load_plugins_registers_every_name_once():
    load_plugins()
    for name in NAMES:
        assert name in registered_radix_cache_backends()
        assert isinstance(get_radix_cache_factory(name), KvcoreFactory)
    # load_plugins runs in every process, maybe twice: a second registration must not raise.
    register_with_sglang()
    register_with_sglang()
    assert registered_radix_cache_backends().count("kvcore-radix") == 1


def test_create_tree_cache_builds_kvcore_radix_and_sglang_logs_it(caplog):
    load_plugins()
    with get_context().override_server_args(radix_cache_backend="kvcore-radix") as server_args:
        ctx = make_ctx(server_args)
        with caplog.at_level(logging.INFO, logger="sglang.srt.mem_cache.registry"):
            cache = create_tree_cache(ctx)
    assert isinstance(cache, KvcoreTreeCache) and isinstance(cache, BasePrefixCache)
    assert "source=registered('kvcore-radix')" in caplog.text
    assert "impl=KvcoreTreeCache" in caplog.text
    # Built on SGLang's own pools.
    assert cache.token_to_kv_pool_allocator is ctx.params.token_to_kv_pool_allocator
    assert cache.req_to_token_pool is ctx.params.req_to_token_pool
    assert cache.kvcore_cache.token_to_kv_pool_allocator.sglang is ctx.params.token_to_kv_pool_allocator
    found = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", [1, 2, 3]))))
    assert found.device_indices.numel() == 0 and found.last_device_node is cache.root_node
    assert cache.evictable_size() == cache.protected_size() == cache.total_size() == 0
    kvcore.InvariantChecker(cache.kvcore_cache).check(owners=[])


def test_chunk_is_a_chunk_cache():
    load_plugins()
    with get_context().override_server_args(radix_cache_backend="kvcore-chunk") as server_args:
        cache = create_tree_cache(make_ctx(server_args))
    assert cache.is_chunk_cache() and cache.disable
    assert cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", [1, 2])))).last_device_node is None
    kvcore.InvariantChecker(cache.kvcore_cache).check(owners=[])


@pytest.mark.parametrize(
    ("name", "ctx_options", "says"),
    [
        ("kvcore-radix", {"hybrid_ssm": True}, "hybrid-ssm model, which kvcore-radix does not serve"),
        ("kvcore-radix", {"hybrid_swa": True}, "hybrid-swa model, which kvcore-radix does not serve"),
        ("kvcore-chunk", {"hybrid_ssm": True}, "hybrid-ssm model, which kvcore-chunk does not serve"),
        ("kvcore-radix", {"hicache": True}, "--enable-hierarchical-cache is not supported"),
        ("kvcore-radix", {"is_eagle": True}, "EAGLE speculative decoding keys the tree by token bigrams"),
        ("kvcore-radix", {"cache_ttl_seconds": 5.0}, "TTL"),
        ("kvcore-radix", {"eviction_policy": "nope"}, "unknown eviction policy 'nope'"),
    ],
)
def test_refuses_what_it_cannot_serve_with_one_clear_error(name, ctx_options, says):
    load_plugins()
    with get_context().override_server_args(radix_cache_backend=name) as server_args:
        ctx = make_ctx(server_args, **ctx_options)
        with pytest.raises(UnsupportedContext, match=says) as err:
            create_tree_cache(ctx)
    assert str(err.value).startswith(f"--radix-cache-backend {name} (SGLang 0.5.19): ")
    # Nothing was taken from SGLang's pools.
    assert ctx.params.token_to_kv_pool_allocator.available_size() == 64


def test_registration_imports_nothing_heavy():
    """SGLang's load_plugins runs before any tree cache exists: registering must not import kvcore or a backend."""
    code = (
        "import sys\n"
        "from kvcore_sglang.plugin import register_with_sglang\n"
        "register_with_sglang()\n"
        "heavy = [m for m in ('kvcore', 'kvcore_radix', 'kvcore_swa', 'kvcore_mamba', 'kvcore_unified',"
        " 'kvcore_sglang.v0_5_19') if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_owner_of_reads_sglang_records_under_kvcore_names():
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    req = Req("r", "", array("q", [5, 6]), SamplingParams())
    owner = owner_of(req)
    assert owner.rid == "r" and not owner.kv.is_held and owner.kv.is_released
    req.kv.req_pool_idx = 3
    assert owner.kv.is_held and owner.kv.req_pool_idx == 3


def test_metrics_collector_is_sglangs():
    load_plugins()
    with get_context().override_server_args(radix_cache_backend="kvcore-radix") as server_args:
        cache = create_tree_cache(make_ctx(server_args, enable_metrics=True))
    assert cache.metrics_collector is not None
    assert type(cache.metrics_collector).__module__.startswith("sglang.")


def make_swa_ctx(server_args, *, page_size=1, size=64, size_swa=32, window=8, **params):
    """A hybrid sliding-window model's context: SGLang's SWATokenToKVPoolAllocator over its SWAKVPool."""
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    pool = SWAKVPool(size=size, size_swa=size_swa, page_size=page_size, dtype=torch.float16, head_num=1, head_dim=1,
                     swa_attention_layer_ids=[0], full_attention_layer_ids=[1], device="cpu")
    alloc = SWATokenToKVPoolAllocator(size, size_swa, page_size, torch.float16, "cpu", pool, False)
    init = CacheInitParams(disable=False, req_to_token_pool=ReqToTokenPool(4, 32, "cpu", False),
                           token_to_kv_pool_allocator=alloc, page_size=page_size, sliding_window_size=window,
                           **params)
    return TreeCacheBuildContext(
        server_args=server_args, params=init, is_hybrid_swa=True, is_hybrid_ssm=False,
        enable_hierarchical_cache=False, disable_radix_cache=False, effective_chunked_prefill_size=None,
        tp_worker=None, model_config=None, tp_size=1, tp_rank=0, tp_group=None,
    )


@pytest.mark.parametrize(("name", "cls"), [("kvcore-swa", "KvcoreUnifiedSWATreeCache"),
                                          ("kvcore-unified", "KvcoreUnifiedSWATreeCache")])
def test_create_tree_cache_builds_a_window_tree_on_sglangs_swa_allocator(caplog, name, cls):
    """kvcore-swa and kvcore-unified: kvcore's one tree with components full + swa, whose SGLang counterpart
    on a hybrid SWA model is its UnifiedRadixCache with components FULL + SWA."""
    from kvcore_sglang import v0_5_19

    load_plugins()
    with get_context().override_server_args(radix_cache_backend=name) as server_args:
        ctx = make_swa_ctx(server_args, page_size=4, window=8)
        with caplog.at_level(logging.INFO, logger="sglang.srt.mem_cache.registry"):
            cache = create_tree_cache(ctx)
    assert type(cache) is getattr(v0_5_19, cls) and f"source=registered('{name}')" in caplog.text
    assert cache.supports_swa() and cache.sliding_window_size == 8 and not cache.is_chunk_cache()
    view = cache.kvcore_cache.token_to_kv_pool_allocator
    assert view.sglang is ctx.params.token_to_kv_pool_allocator
    assert (view.size_full, view.size_swa) == (64, 32)
    assert cache.total_size() == (0, 0)
    assert cache.full_evictable_size() == cache.swa_evictable_size() == cache.swa_protected_size() == 0
    assert cache.kvcore_cache.config.components == ("full", "swa")
    # As SGLang's UnifiedRadixCache: the plain sizes answered (the full pool's), no retain floor.
    assert cache.evictable_size() == cache.protected_size() == 0 and cache.swa_retain_floor(None) is None
    assert cache.available_and_evictable_str() == (
        "Available full tokens: 64 (full_available_size=64 + full_evictable_size_=0)\n"
        "Available swa: 32 (available_size=32 + component_evictable_size_=0)\n")
    kvcore.InvariantChecker(cache.kvcore_cache).check(owners=[])


@pytest.mark.parametrize("name", ["kvcore-swa", "kvcore-unified"])
@pytest.mark.parametrize(
    ("ctx_options", "says"),
    [
        ({"eviction_policy": "lfu"}, "takes eviction_policy 'lru' only"),
        ({"is_eagle": True}, "EAGLE speculative decoding"),
        ({"window": 31}, "cannot hold one request's window"),
        ({"window": None}, "SGLang gave no sliding_window_size"),
    ],
)
def test_kvcore_swa_refuses_what_it_cannot_serve(name, ctx_options, says):
    load_plugins()
    with get_context().override_server_args(radix_cache_backend=name) as server_args:
        ctx = make_swa_ctx(server_args, **ctx_options)
        with pytest.raises(UnsupportedContext, match=says):
            create_tree_cache(ctx)
    alloc = ctx.params.token_to_kv_pool_allocator
    assert (alloc.full_available_size(), alloc.swa_available_size()) == (64, 32)


def test_kvcore_swa_refuses_full_models_and_other_allocators():
    load_plugins()
    with get_context().override_server_args(radix_cache_backend="kvcore-swa") as server_args:
        with pytest.raises(UnsupportedContext, match="full model, which kvcore-swa does not serve"):
            create_tree_cache(make_ctx(server_args))
        with pytest.raises(UnsupportedContext, match="needs SGLang's SWATokenToKVPoolAllocator"):
            create_tree_cache(make_ctx(server_args, hybrid_swa=True, sliding_window_size=8))


def test_kvcore_unified_refuses_other_allocators_for_a_hybrid_swa_model():
    load_plugins()
    with get_context().override_server_args(radix_cache_backend="kvcore-unified") as server_args:
        with pytest.raises(UnsupportedContext, match="needs SGLang's SWATokenToKVPoolAllocator"):
            create_tree_cache(make_ctx(server_args, hybrid_swa=True, sliding_window_size=8))
        # A full model on a two-pool allocator: neither component set fits it.
        with pytest.raises(UnsupportedContext, match="a hybrid SWA allocator on a model not marked hybrid SWA"):
            ctx = make_swa_ctx(server_args)
            ctx.is_hybrid_swa = False
            create_tree_cache(ctx)


def strict_cache(monkeypatch, name, make):
    """A cache built with KVCORE_SGLANG_STRICT=1 for --radix-cache-backend ``name`` on ``make(server_args)``'s
    context; returns (context, cache, a fresh four-token SGLang Req)."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    monkeypatch.setenv("KVCORE_SGLANG_STRICT", "1")
    load_plugins()
    with get_context().override_server_args(radix_cache_backend=name) as server_args:
        ctx = make(server_args)
        cache = create_tree_cache(ctx)
    return ctx, cache, Req("r", "", array("q", [1, 2, 3, 4]), SamplingParams())


def test_strict_slot_checks_refuse_a_free_slot_and_change_nothing(monkeypatch):
    """KVCORE_SGLANG_STRICT=1: a request whose row names slots SGLang's allocator holds free is refused."""
    ctx, cache, req = strict_cache(monkeypatch, "kvcore-radix", make_ctx)
    alloc, r2t = ctx.params.token_to_kv_pool_allocator, ctx.params.req_to_token_pool
    req.kv.req_pool_idx = r2t.alloc([req])[0]
    held = alloc.alloc(2)
    # Two slots the request holds, two that are still free in SGLang's allocator.
    r2t.req_to_token[req.kv.req_pool_idx, :4] = torch.cat((held, torch.tensor([60, 61]))).to(torch.int32)
    req.kv.kv_allocated_len = req.kv.kv_committed_len = 4
    before = alloc.free_pages.tolist()
    with pytest.raises(ValueError, match="slot 60 is free"):
        cache.cache_finished_req(req, kv_len_to_handle=4)
    assert alloc.free_pages.tolist() == before and cache.total_size() == 0
    with pytest.raises(UnsupportedContext, match="KVCORE_SGLANG_STRICT='yes'"):
        monkeypatch.setenv("KVCORE_SGLANG_STRICT", "yes")
        with get_context().override_server_args(radix_cache_backend="kvcore-radix") as server_args:
            create_tree_cache(make_ctx(server_args))


def make_mamba_ctx(server_args, *, rows=4, mamba_size=8, size=64, page_size=1, extra_buffer=False, hybrid_ssm=True,
                   **params):
    """A hybrid SSM model's context: SGLang's HybridReqToTokenPool (a MambaPool of two small layers)."""
    from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool

    from tools.sglang_request_path_shim import MambaWorld

    server_args._mamba_cache_chunk_size = 4
    r2t = HybridReqToTokenPool(
        size=rows, mamba_size=mamba_size, mamba_spec_state_size=mamba_size, max_context_len=32, device="cpu",
        enable_memory_saver=False, cache_params=MambaWorld.state_shape(), mamba_layer_ids=[0, 1],
        enable_mamba_extra_buffer=extra_buffer, enable_overlap_schedule=True,
    )
    if page_size == 1:
        alloc = TokenToKVPoolAllocator(size, torch.float16, "cpu", None, False)
    else:
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator

        alloc = PagedTokenToKVPoolAllocator(size, page_size, torch.float16, "cpu", None, False)
    init = CacheInitParams(disable=False, req_to_token_pool=r2t, token_to_kv_pool_allocator=alloc,
                           page_size=page_size, enable_mamba_extra_buffer=extra_buffer, **params)
    return TreeCacheBuildContext(
        server_args=server_args, params=init, is_hybrid_swa=False, is_hybrid_ssm=hybrid_ssm,
        enable_hierarchical_cache=False, disable_radix_cache=False, effective_chunked_prefill_size=None,
        tp_worker=None, model_config=None, tp_size=1, tp_rank=0, tp_group=None,
    )


@pytest.mark.parametrize("name", ["kvcore-mamba", "kvcore-unified"])
def test_create_tree_cache_builds_kvcore_mamba_on_sglangs_hybrid_pool(caplog, name):
    """kvcore-mamba and kvcore-unified: kvcore's one tree with components full + mamba, whose SGLang counterpart
    on a hybrid SSM model is its UnifiedRadixCache with components FULL + MAMBA."""
    from kvcore_sglang.v0_5_19 import KvcoreUnifiedMambaTreeCache

    load_plugins()
    with get_context().override_server_args(radix_cache_backend=name) as server_args:
        ctx = make_mamba_ctx(server_args)
        with caplog.at_level(logging.INFO, logger="sglang.srt.mem_cache.registry"):
            cache = create_tree_cache(ctx)
    assert type(cache) is KvcoreUnifiedMambaTreeCache and f"source=registered('{name}')" in caplog.text
    assert cache.kvcore_cache.config.components == ("full", "mamba")
    assert cache.supports_mamba() and not cache.supports_swa() and not cache.is_chunk_cache()
    backend = cache.kvcore_cache
    r2t = ctx.params.req_to_token_pool
    assert backend.req_to_token_pool.sglang is r2t and backend.mamba_pool.sglang is r2t.mamba_allocator
    assert backend.mamba_cache_chunk_size == 4     # SGLang's mamba_cache_chunk_size(), as its own cache reads it
    assert cache.total_size() == (0, 0)
    assert cache.full_evictable_size() == cache.mamba_evictable_size() == cache.mamba_protected_size() == 0
    assert cache.available_and_evictable_str() == (
        "Available full tokens: 64 (full_available_size=64 + full_evictable_size_=0)\n"
        "Available mamba: 8 (available_size=8 + component_evictable_size_=0)\n")
    assert cache.all_values_flatten().numel() == cache.all_mamba_values_flatten().numel() == 0
    kvcore.InvariantChecker(backend).check(owners=[])
    # The extra-buffer strategy with pages: SGLang's scheduler tracks the snapshots.
    with get_context().override_server_args(radix_cache_backend=name) as server_args:
        cache = create_tree_cache(make_mamba_ctx(server_args, page_size=4, mamba_size=12, extra_buffer=True))
    assert cache.kvcore_cache.req_to_token_pool.tracks_states


@pytest.mark.parametrize(
    ("ctx_options", "says"),
    [
        ({"page_size": 4}, "page size 4 needs the extra-buffer Mamba strategy"),
        ({"extra_buffer": True, "enable_mamba_extra_buffer_lazy": True}, "lazy extra-buffer Mamba strategy"),
        ({"eviction_policy": "lfu"}, "takes eviction_policy 'lru' only"),
        ({"is_eagle": True}, "EAGLE speculative decoding"),
        ({"hybrid_ssm": False}, "full model, which kvcore-mamba does not serve"),
    ],
)
def test_kvcore_mamba_refuses_what_it_cannot_serve(ctx_options, says):
    load_plugins()
    with get_context().override_server_args(radix_cache_backend="kvcore-mamba") as server_args:
        ctx = make_mamba_ctx(server_args, **ctx_options)
        with pytest.raises(UnsupportedContext, match=says):
            create_tree_cache(ctx)
    assert ctx.params.token_to_kv_pool_allocator.available_size() == 64
    assert ctx.params.req_to_token_pool.mamba_allocator.available_size() == 8
    # A hybrid SSM model without SGLang's hybrid request table.
    with get_context().override_server_args(radix_cache_backend="kvcore-mamba") as server_args:
        with pytest.raises(UnsupportedContext, match="needs SGLang's HybridReqToTokenPool"):
            create_tree_cache(make_ctx(server_args, hybrid_ssm=True))


@pytest.mark.usefixtures("sglang_request_path")
def test_kvcore_mamba_strict_refuses_a_free_state_slot_and_changes_nothing(monkeypatch):
    """KVCORE_SGLANG_STRICT=1: a finishing request whose state slot SGLang's allocator holds free is refused."""
    from sglang.srt.mem_cache.common import release_kv_cache

    ctx, cache, req = strict_cache(monkeypatch, "kvcore-mamba", make_mamba_ctx)
    alloc, r2t = ctx.params.token_to_kv_pool_allocator, ctx.params.req_to_token_pool
    req.last_node = cache.root_node
    req.kv.req_pool_idx = r2t.alloc([req])[0]          # SGLang's: a row and a state slot
    r2t.req_to_token[req.kv.req_pool_idx, :4] = alloc.alloc(4).to(torch.int32)
    req.kv.kv_allocated_len = req.kv.kv_committed_len = 4
    held = req.kv.mamba_pool_idx
    req.kv.mamba_pool_idx = torch.tensor(8)            # a state slot SGLang's allocator still holds free
    before = (alloc.free_pages.tolist(), r2t.mamba_allocator.free_slots.tolist())
    with pytest.raises(ValueError, match="slot 8 is free"):
        cache.cache_finished_req(req, kv_len_to_handle=4)
    assert (alloc.free_pages.tolist(), r2t.mamba_allocator.free_slots.tolist()) == before
    assert cache.total_size() == (0, 0)
    req.kv.mamba_pool_idx = held
    cache.inc_lock_ref(cache.root_node)   # what admission took; cache_finished_req gives it back
    release_kv_cache(req, cache)           # SGLang's release: cache_finished_req, then the row
    # The tree took the state slot; SGLang's record keeps pointing at it, as its MambaRadixCache leaves it.
    assert cache.total_size() == (4, 1) and int(req.kv.mamba_pool_idx) == int(held)
    assert int(held) not in r2t.mamba_allocator.free_slots.tolist()
    kvcore.InvariantChecker(cache.kvcore_cache).check(owners=[])


def test_another_distribution_declares_its_backend_for_sglang(caplog):
    """kvcore-example-backend declares ``example`` in group kvcore_sglang.targets: SGLang gets kvcore-example."""
    from kvcore_sglang.plugin import TARGET_GROUP, declared_targets

    assert ("kvcore-example", "kvcore_example.sglang:TARGET") in [(n, ep.value) for n, ep in declared_targets()]
    assert TARGET_GROUP == "kvcore_sglang.targets"
    load_plugins()
    factory = get_radix_cache_factory("kvcore-example")
    assert isinstance(factory, KvcoreFactory) and factory.target is None     # not loaded by registering
    with get_context().override_server_args(radix_cache_backend="kvcore-example") as server_args:
        ctx = make_ctx(server_args)
        with caplog.at_level(logging.INFO, logger="sglang.srt.mem_cache.registry"):
            cache = create_tree_cache(ctx)
    assert isinstance(cache, KvcoreTreeCache) and "source=registered('kvcore-example')" in caplog.text
    assert type(cache.kvcore_cache).__name__ == "ExampleCache"
    assert cache.kvcore_cache.token_to_kv_pool_allocator.sglang is ctx.params.token_to_kv_pool_allocator
    kvcore.InvariantChecker(cache.kvcore_cache).check(owners=[])
    # A hybrid model is refused by name, as for kvcore's own targets.
    with get_context().override_server_args(radix_cache_backend="kvcore-example") as server_args:
        with pytest.raises(UnsupportedContext, match="hybrid-ssm model, which kvcore-example does not serve"):
            create_tree_cache(make_ctx(server_args, hybrid_ssm=True))


def test_a_declared_target_that_is_not_a_target_is_refused_by_name():
    from importlib.metadata import EntryPoint

    factory = KvcoreFactory(entry_point=EntryPoint("broken", "kvcore_sglang.config:TARGETS", "kvcore_sglang.targets"))
    with pytest.raises(RuntimeError, match="must name a kvcore_sglang.Target with name='kvcore-broken'"):
        factory(None)
    factory = KvcoreFactory(entry_point=EntryPoint("gone", "no_such_module:TARGET", "kvcore_sglang.targets"))
    with pytest.raises(RuntimeError, match="does not load: ModuleNotFoundError"):
        factory(None)

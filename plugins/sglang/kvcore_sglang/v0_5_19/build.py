"""SGLang 0.5.19's factory behind every kvcore name: refuse what cannot be served, else build on SGLang's pools."""

from __future__ import annotations

from typing import Any

from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator  # type: ignore[import-not-found,unused-ignore]
from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool  # type: ignore[import-not-found,unused-ignore]

import kvcore
from kvcore.plugins import get_backend
from kvcore_sglang.common.build import (
    UnsupportedContext,
    build_kvcore,
    mamba_options,
    model_kind,
    shared_refusals,
    swa_options,
    tree_options,
)
from kvcore_sglang.config import Target
from kvcore_sglang.v0_5_19.tree_cache import (
    KvcoreTreeCache,
    KvcoreUnifiedMambaTreeCache,
    KvcoreUnifiedSWATreeCache,
    KvcoreUnifiedTreeCache,
)
from kvcore_sglang.v0_5_19.version import SGLANG_VERSION

__all__ = ["build_tree_cache"]


def _refuse(target: Target, ctx: Any) -> None:
    """One clear error for a context ``target`` cannot serve, before anything is built."""
    params = ctx.params
    name = target.name
    kind = model_kind(ctx)
    problems = shared_refusals(target, ctx)
    if params.cache_ttl_seconds is not None:
        problems.append("cache entry TTL (cache_ttl_seconds) is not supported by kvcore")
    if params.token_to_kv_pool_allocator is not None and isinstance(
        params.token_to_kv_pool_allocator, SWATokenToKVPoolAllocator
    ) and kind == "full":
        problems.append("a hybrid SWA allocator on a model not marked hybrid SWA")
    if problems:
        raise UnsupportedContext(f"--radix-cache-backend {name} (SGLang {SGLANG_VERSION}): " + "; ".join(problems))


def _build(target: Target, backend: str, params: Any, **options: Any) -> Any:
    return build_kvcore(target, backend, params, sglang_version=SGLANG_VERSION, **options)


def build_tree_cache(target: Target, ctx: Any) -> KvcoreTreeCache:
    """The factory behind every kvcore name: refuse what cannot be served, else build on SGLang's pools."""
    _refuse(target, ctx)
    params = ctx.params
    if target.backend == "radix":
        if isinstance(params.req_to_token_pool, HybridReqToTokenPool):
            raise UnsupportedContext(f"--radix-cache-backend {target.name}: a HybridReqToTokenPool (mamba states) "
                                     "on a model not marked hybrid SSM")
        cache = _build(
            target, "radix", params,
            **tree_options(params),
        )
    elif target.backend == "swa" or (target.backend == "unified" and ctx.is_hybrid_swa):
        # SGLang's default tree on a hybrid SWA model (UnifiedRadixCache): kvcore's one tree with components
        # full + swa on SGLang's two-pool allocator, under either name.
        sets = {"components": ("full", "swa")} if target.backend == "unified" else {}
        cache = _build(target, target.backend, params, **sets, **swa_options(target, params), **tree_options(params))
        return KvcoreUnifiedSWATreeCache(target, cache, params)
    elif target.backend == "mamba" or (target.backend == "unified" and ctx.is_hybrid_ssm):
        # SGLang's default tree on a hybrid SSM model: components full + mamba on its HybridReqToTokenPool.
        sets = {"components": ("full", "mamba")} if target.backend == "unified" else {}
        cache = _build(target, target.backend, params, **sets, **mamba_options(target, params),
                       **tree_options(params))
        return KvcoreUnifiedMambaTreeCache(target, cache, params)
    elif target.backend == "unified":
        # SGLang's default tree; on a full-attention model its one component is full.
        cache = _build(
            target, "unified", params,
            components=("full",),
            **tree_options(params),
        )
        return KvcoreUnifiedTreeCache(target, cache, params)
    elif target.backend == "chunk":
        if params.token_to_kv_pool_allocator is None:
            raise UnsupportedContext(f"--radix-cache-backend {target.name}: needs SGLang's token_to_kv_pool_allocator")
        cache = _build(target, "chunk", params, strict=False)
    elif target.serves == ("full",):
        # Another distribution's backend for full-attention models (declared in kvcore_sglang.targets):
        # on SGLang's pools as kvcore-radix is, with the options every kvcore tree config has.
        try:
            get_backend(target.backend)
        except kvcore.KvcoreError as exc:
            raise UnsupportedContext(f"--radix-cache-backend {target.name}: {exc}") from None
        cache = _build(
            target, target.backend, params,
            **tree_options(params),
        )
    else:
        raise UnsupportedContext(
            f"--radix-cache-backend {target.name}: kvcore-sglang {SGLANG_VERSION} builds another "
            f"distribution's backend ({target.backend!r}) for full-attention models only; give the Target a "
            "builder for the other model kinds"
        )
    return KvcoreTreeCache(target, cache, params)

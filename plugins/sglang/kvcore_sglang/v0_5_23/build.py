"""SGLang 0.5.23's factory behind every kvcore name: refuse what cannot be served, else build on SGLang's pools."""

from __future__ import annotations

from typing import Any

from sglang.srt.mem_cache.allocator.paged import (  # type: ignore[import-not-found,unused-ignore]
    PagedTokenToKVPoolAllocator,
)
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator  # type: ignore[import-not-found,unused-ignore]
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool  # type: ignore[import-not-found,unused-ignore]

import kvcore
from kvcore.plugins import get_backend
from kvcore_sglang.common.build import (
    UnsupportedContext,
    build_kvcore,
    model_kind,
    shared_refusals,
    targets_for,
    tree_options,
)
from kvcore_sglang.config import Target
from kvcore_sglang.v0_5_23.tree_cache import KvcoreChunkCache, KvcoreTreeCache, KvcoreUnifiedTreeCache
from kvcore_sglang.v0_5_23.version import SGLANG_VERSION

__all__ = ["SERVED", "build_tree_cache"]

#: What each kvcore backend serves on SGLang 0.5.23 (model kinds); the rest of config.TARGETS is refused by name.
SERVED: dict[str, tuple[str, ...]] = {"radix": ("full",), "unified": ("full",), "chunk": ("full",)}

# The names not served on SGLang 0.5.23 and why: each is kvcore's one tree with a hybrid model's components,
# SGLang's UnifiedRadixCache with those components, which kvcore-unified does not serve there either.
_NOT_YET = {
    "swa": "kvcore-swa is kvcore's one tree with components full + swa (SGLang's UnifiedRadixCache), which "
           "kvcore-sglang does not serve on SGLang 0.5.23 yet",
    "mamba": "kvcore-mamba is kvcore's one tree with components full + mamba (SGLang's UnifiedRadixCache), which "
             "kvcore-sglang does not serve on SGLang 0.5.23 yet",
}

# Why kvcore-unified refuses the hybrid kinds on SGLang 0.5.23 (it serves component full alone there).
_UNIFIED_HYBRID = {
    "hybrid-swa": "kvcore-sglang does not serve SGLang 0.5.23's UnifiedRadixCache with components full + swa yet",
    "hybrid-ssm": "kvcore-sglang does not serve SGLang 0.5.23's UnifiedRadixCache with components full + mamba yet",
}


def _served_by(kind: str) -> list[str]:
    """The kvcore names that serve ``kind`` on SGLang 0.5.23."""
    return [name for name in targets_for(kind) if kind in SERVED.get(name.removeprefix("kvcore-"), ())]


def _refuse(target: Target, ctx: Any) -> None:
    """One clear error for a context ``target`` cannot serve on SGLang 0.5.23, before anything is built."""
    params = ctx.params
    problems = []
    if target.backend in _NOT_YET:
        others = _served_by(model_kind(ctx))
        instead = f"use {' or '.join(others)}" if others else "leave --radix-cache-backend unset for SGLang's own tree"
        problems.append(f"{_NOT_YET[target.backend]} ({instead})")
        problems += shared_refusals(target, ctx, serves=(model_kind(ctx),))
    else:
        if target.backend == "unified" and model_kind(ctx) in _UNIFIED_HYBRID:
            problems.append(_UNIFIED_HYBRID[model_kind(ctx)])
        problems += shared_refusals(target, ctx, serves=SERVED.get(target.backend, target.serves), served_by=_served_by)
    if params.eviction_policy_config:
        problems.append("eviction policy options (eviction_policy_config) are not supported by kvcore")
    if params.draft_swa_window or params.mtp_draft_device_pools or params.sidecar_draft_device_pools:
        problems.append("speculative draft pools (draft_swa_window, mtp/sidecar draft pools) are not supported by "
                        "kvcore")
    alloc, r2t = params.token_to_kv_pool_allocator, params.req_to_token_pool
    if not problems and alloc is not None and type(alloc) not in (TokenToKVPoolAllocator, PagedTokenToKVPoolAllocator):
        # SGLang 0.5.23's other allocators (SWA, page-interleaved, unified sub-pools, HiSparse) keep other free
        # lists or virtual ids, which kvcore's allocator view does not model.
        problems.append(f"needs SGLang's TokenToKVPoolAllocator or PagedTokenToKVPoolAllocator, got "
                        f"{type(alloc).__name__}")
    if not problems and r2t is not None and type(r2t) is not ReqToTokenPool:
        problems.append(f"needs SGLang's ReqToTokenPool, got {type(r2t).__name__}")
    if problems:
        raise UnsupportedContext(f"--radix-cache-backend {target.name} (SGLang {SGLANG_VERSION}): "
                                 + "; ".join(problems))


def build_tree_cache(target: Target, ctx: Any) -> KvcoreTreeCache:
    """The factory behind every kvcore name on SGLang 0.5.23: refuse what cannot be served, else build."""
    _refuse(target, ctx)
    params = ctx.params
    if target.backend == "chunk":
        if params.token_to_kv_pool_allocator is None:
            raise UnsupportedContext(f"--radix-cache-backend {target.name}: needs SGLang's token_to_kv_pool_allocator")
        cache = build_kvcore(target, "chunk", params, sglang_version=SGLANG_VERSION, strict=False)
        return KvcoreChunkCache(target, cache, params)
    if target.backend == "unified":
        # SGLang 0.5.23's default tree on a full-attention model: UnifiedRadixCache with its one component full.
        cache = build_kvcore(target, "unified", params, sglang_version=SGLANG_VERSION, components=("full",),
                             **tree_options(params))
        return KvcoreUnifiedTreeCache(target, cache, params)
    if target.backend != "radix":
        # Another distribution's backend for full-attention models (declared in kvcore_sglang.targets),
        # built as kvcore-radix is: it must be a tree with kvcore's radix node fields.
        try:
            get_backend(target.backend)
        except kvcore.KvcoreError as exc:
            raise UnsupportedContext(f"--radix-cache-backend {target.name}: {exc}") from None
    cache = build_kvcore(target, target.backend, params, sglang_version=SGLANG_VERSION, **tree_options(params))
    return KvcoreTreeCache(target, cache, params)

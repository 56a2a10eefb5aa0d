"""What every version's factory shares: the refusal error, the strict switch, the option builders, the build.

Version-neutral: the pool classes it tells apart (``SWATokenToKVPoolAllocator``,
``HybridReqToTokenPool``, ``TokenToKVPoolAllocator``, ``PagedTokenToKVPoolAllocator``), the pool
fields and the ``CacheInitParams`` fields it reads are the same in SGLang 0.5.19 and 0.5.23.
A version's contract module passes its version for the messages.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, cast

from sglang.srt.mem_cache.allocator.paged import (  # type: ignore[import-not-found,unused-ignore]
    PagedTokenToKVPoolAllocator,
)
from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator  # type: ignore[import-not-found,unused-ignore]
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator  # type: ignore[import-not-found,unused-ignore]
from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool  # type: ignore[import-not-found,unused-ignore]
from sglang.srt.runtime_context import mamba_cache_chunk_size  # type: ignore[import-not-found,unused-ignore]

import kvcore
from kvcore.config import CacheInitParams
from kvcore.factory import attach_lifecycle
from kvcore.plugins import get_backend, get_plugin_manager
from kvcore_sglang.common.pool_views import (
    AllocatorView,
    HybridReqToTokenPoolView,
    ReqToTokenPoolView,
    SWAAllocatorView,
)
from kvcore_sglang.config import TARGETS, Target

__all__ = ["STRICT_ENV", "UnsupportedContext", "build_kvcore", "mamba_options", "model_kind", "shared_refusals",
           "strict_slots", "swa_options", "targets_for", "tree_options"]


class UnsupportedContext(kvcore.KvcoreError, ValueError):
    """SGLang asked a kvcore name for a tree cache it cannot serve (the message says what to change)."""


#: Set to 1 to turn kvcore's strict slot checks on over SGLang's pools (0, the default: off).
STRICT_ENV = "KVCORE_SGLANG_STRICT"


def strict_slots() -> bool:
    """Whether kvcore's strict slot checks run on SGLang's pools (``KVCORE_SGLANG_STRICT=1``).

    Off by default: SGLang's allocator keeps its free pages as a list, so every insert's
    check builds the free mask from that list (a pass over the free list per insert).  On,
    an insert or a request's cache call refuses padding, out-of-range, free, repeated or
    already-owned slots before anything changes, and a free refuses a slot a tree node still
    owns, before SGLang frees anything.
    """
    value = os.environ.get(STRICT_ENV, "0")
    if value not in ("0", "1"):
        raise UnsupportedContext(f"{STRICT_ENV}={value!r}: use 1 (strict slot checks on) or 0 (off)")
    return value == "1"


def targets_for(kind: str) -> list[str]:
    """kvcore-sglang's own names that serve model kind ``kind``."""
    return [t.name for t in TARGETS if kind in t.serves]


def model_kind(ctx: Any) -> str:
    """The model kind of SGLang's ``TreeCacheBuildContext`` (``config.ModelKind``)."""
    return "hybrid-ssm" if ctx.is_hybrid_ssm else "hybrid-swa" if ctx.is_hybrid_swa else "full"


def shared_refusals(target: Target, ctx: Any, *, serves: tuple[str, ...] | None = None,
                    served_by: Callable[[str], list[str]] = targets_for) -> list[str]:
    """What no version serves for ``target`` in ``ctx``, one problem a line (empty: nothing refused here).

    ``serves``: the model kinds ``target`` serves on the running SGLang (its ``Target.serves`` by
    default); ``served_by(kind)``: the names to point a refused kind to.
    """
    params = ctx.params
    kind = model_kind(ctx)
    problems = []
    if kind not in (target.serves if serves is None else serves):
        others = served_by(kind)
        instead = (f"use {' or '.join(others)}" if others else
                   "no kvcore name serves it yet: leave --radix-cache-backend unset for SGLang's own tree")
        problems.append(f"this is a {kind} model, which {target.name} does not serve ({instead})")
    if ctx.enable_hierarchical_cache:
        problems.append("--enable-hierarchical-cache is not supported by kvcore (drop it)")
    if params.is_eagle:
        problems.append("EAGLE speculative decoding keys the tree by token bigrams, which kvcore does not support")
    if params.enable_session_radix_cache:
        problems.append("--enable-session-radix-cache is not supported by kvcore")
    if getattr(ctx, "is_dsa", False):
        problems.append("DSA (DeepSeek sparse attention) pools are not supported by kvcore")
    return problems


def build_kvcore(target: Target, backend: str, params: Any, *, sglang_version: str, **options: Any) -> Any:
    """Build kvcore backend ``backend`` on views of SGLang's pools, with its lifecycle relay.

    ``sglang_version`` names the running SGLang in a refusal.
    """
    spec = get_backend(backend)
    alloc = params.token_to_kv_pool_allocator
    r2t = params.req_to_token_pool
    page_size = int(params.page_size)
    swa = isinstance(alloc, SWATokenToKVPoolAllocator)
    if alloc is not None:
        # The config records the pools' shape; the pools themselves are SGLang's.
        options.setdefault("size", int(alloc.size_full if swa else alloc.size) // page_size * page_size)
    if r2t is not None:
        options.setdefault("max_num_reqs", int(r2t.size))
        options.setdefault("max_context_len", -(-int(r2t.max_context_len) // page_size) * page_size)
    try:
        config = spec.config(page_size=page_size, **options)
        # SGLang's tree-only RadixCache (its unit tests) has no pools: the radix backend serves it without.
        init = CacheInitParams(
            req_to_token_pool=cast(Any, None if r2t is None else HybridReqToTokenPoolView(r2t)
                                   if isinstance(r2t, HybridReqToTokenPool) else ReqToTokenPoolView(r2t)),
            token_to_kv_pool_allocator=cast(
                Any, None if alloc is None else SWAAllocatorView(alloc) if swa else AllocatorView(alloc)
            ),
            page_size=page_size,
            config=config,
        )
        cache = spec.factory(init)
    except (TypeError, ValueError) as exc:  # pydantic's ValidationError is a ValueError
        raise UnsupportedContext(
            f"--radix-cache-backend {target.name} (SGLang {sglang_version}): kvcore backend {backend!r} "
            f"refuses SGLang's options: {exc}"
        ) from None
    cache.backend_name = backend
    attach_lifecycle(cache)
    get_plugin_manager().hook.kvcore_cache_created(cache=cache)
    return cache


def swa_options(target: Target, params: Any) -> dict[str, int]:
    """The window options of a kvcore SWA tree on SGLang's pools; refuses pools it cannot model."""
    alloc = params.token_to_kv_pool_allocator
    # Exactly SGLang's two-pool allocator: its pure-SWA and shared (multi-ended) variants keep
    # other free lists, which kvcore's SWA allocator view does not model.
    if type(alloc) is not SWATokenToKVPoolAllocator:
        raise UnsupportedContext(
            f"--radix-cache-backend {target.name}: needs SGLang's SWATokenToKVPoolAllocator (full + window "
            f"pools), got {type(alloc).__name__}"
        )
    if isinstance(params.req_to_token_pool, HybridReqToTokenPool):
        raise UnsupportedContext(f"--radix-cache-backend {target.name}: a model with both sliding-window and "
                                 "mamba layers (HybridReqToTokenPool) is not supported by kvcore")
    if not params.sliding_window_size:
        raise UnsupportedContext(f"--radix-cache-backend {target.name}: SGLang gave no sliding_window_size")
    page_size = int(params.page_size)
    return {"swa_size": int(alloc.size_swa) // page_size * page_size,
            "sliding_window_size": int(params.sliding_window_size)}


def mamba_options(target: Target, params: Any) -> dict[str, Any]:
    """The state options of a kvcore tree on SGLang's ``HybridReqToTokenPool``; refuses what it cannot serve."""
    r2t, alloc = params.req_to_token_pool, params.token_to_kv_pool_allocator
    name = f"--radix-cache-backend {target.name}"
    # Exactly SGLang's static pools: the unified (shared-memory) variants hand out virtual state ids.
    if type(r2t) is not HybridReqToTokenPool:
        raise UnsupportedContext(f"{name}: needs SGLang's HybridReqToTokenPool (a request row and a Mamba state "
                                 f"slot per request), got {type(r2t).__name__}")
    if type(alloc) not in (TokenToKVPoolAllocator, PagedTokenToKVPoolAllocator):
        raise UnsupportedContext(f"{name}: needs SGLang's TokenToKVPoolAllocator or PagedTokenToKVPoolAllocator, "
                                 f"got {type(alloc).__name__}")
    if bool(r2t.enable_mamba_extra_buffer) != bool(params.enable_mamba_extra_buffer):
        raise UnsupportedContext(f"{name}: the cache and SGLang's HybridReqToTokenPool disagree on the "
                                 "extra-buffer Mamba strategy")
    if r2t.enable_mamba_extra_buffer_lazy or params.enable_mamba_extra_buffer_lazy:
        raise UnsupportedContext(f"{name}: the lazy extra-buffer Mamba strategy (--mamba-scheduler-strategy "
                                 "extra_buffer_lazy) is not supported by kvcore: use extra_buffer or no_buffer")
    if int(params.page_size) > 1 and not r2t.enable_mamba_extra_buffer:
        raise UnsupportedContext(f"{name}: page size {params.page_size} needs the extra-buffer Mamba strategy "
                                 "(--mamba-scheduler-strategy extra_buffer), as SGLang's Mamba trees do")
    if r2t.mamba_ckpt_pool is not None:
        raise UnsupportedContext(f"{name}: int8 Mamba checkpoints (--enable-int8-mamba-checkpoint) are not "
                                 "supported by kvcore (drop the flag)")
    if r2t.mamba_pool.replayssm_write_pos is not None:
        raise UnsupportedContext(f"{name}: ReplaySSM (--enable-linear-replayssm) is not supported by kvcore "
                                 "(drop the flag)")
    return {
        "mamba_size": int(r2t.mamba_allocator.size),
        # SGLang's caching point granularity, as its own Mamba trees read it.
        "mamba_cache_chunk_size": int(mamba_cache_chunk_size()),
    }


def tree_options(params: Any) -> dict[str, Any]:
    """The options every kvcore tree takes from SGLang's ``CacheInitParams`` (and ``KVCORE_SGLANG_STRICT``)."""
    return {
        "eviction_policy": str(params.eviction_policy).lower(),
        "enable_kv_events": bool(params.enable_kv_cache_events),
        "disable": bool(params.disable),
        # Key checks are always on; the slot checks (claims) on request, with an allocator to check against.
        "strict": strict_slots() and params.token_to_kv_pool_allocator is not None,
    }

"""Backend ``npu``: the core tree with RadixCache's answers on NPU pools, a configuration rather than a second tree.

kvcore keeps one radix tree: the core's (:class:`kvcore.tree.unified.UnifiedRadixCache`).
The device ``npu`` is registered with SGLang's NPU allocator and K/V-pool classes, so
``radix`` (and any tree backend) already runs on it (``create_cache("radix",
device="npu")``).  Backend ``npu`` is that same tree, built as the ``radix`` backend
builds it (the component set ``("full",)`` with SGLang RadixCache's answers:
:class:`kvcore.tree.unified_config.RadixTreeConfig`), with Ascend's defaults: page size
128 and the NPU pools even on ``device="cpu"`` (:class:`kvcore_npu.NpuPools`), which is
how CI exercises the NPU code path.  It needs no other backend installed.
"""

from __future__ import annotations

from kvcore import BasePrefixCache, CacheInitParams
from kvcore.tree.unified import UnifiedRadixCache
from kvcore.tree.unified_config import RadixTreeConfig

__all__ = ["build_npu_cache"]


def build_npu_cache(params: CacheInitParams) -> BasePrefixCache:
    """Build the core tree with RadixCache's answers on ``params``' NPU pools (the ``npu`` backend's factory)."""
    # NpuConfig's options are all the tree's too; the tree's own model validates them again.
    config = RadixTreeConfig(**params.config.model_dump())
    return UnifiedRadixCache(
        CacheInitParams(
            req_to_token_pool=params.req_to_token_pool,
            token_to_kv_pool_allocator=params.token_to_kv_pool_allocator,
            page_size=params.page_size,
            config=config,
            kv_pool=params.kv_pool,
        )
    )

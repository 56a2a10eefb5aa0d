"""Backend ``npu``: the ``radix`` backend's tree on NPU pools, a configuration rather than a second tree.

kvcore keeps one radix tree: kvcore-radix's.  The device ``npu`` is registered
with SGLang's NPU allocator and K/V-pool classes, so ``radix`` (and any tree
backend) already runs on it (``create_cache("radix", device="npu")``).  Backend
``npu`` is that same tree with Ascend's defaults: page size 128 and the NPU pools
even on ``device="cpu"`` (:class:`kvcore_npu.NpuPools`), which is how
CI exercises the NPU code path.  The ``radix`` factory is found through kvcore's
registry at build time; this package never imports kvcore_radix.
"""

from __future__ import annotations

from kvcore import BasePrefixCache, CacheInitParams
from kvcore.plugins import get_backend

__all__ = ["build_npu_cache"]

TREE_BACKEND = "radix"


def build_npu_cache(params: CacheInitParams) -> BasePrefixCache:
    """Build the ``radix`` backend on ``params``' NPU pools (the ``npu`` backend's factory)."""
    try:
        tree = get_backend(TREE_BACKEND)
    except LookupError as exc:
        raise LookupError(
            f"backend 'npu' runs the {TREE_BACKEND!r} backend's tree on NPU pools, and it is not available "
            f"({exc}); install kvcore-radix (plugins/radix)"
        ) from None
    # NpuConfig's options are all the tree backend's too; its own model validates them again.
    config = tree.config(**params.config.model_dump())
    return tree.factory(
        CacheInitParams(
            req_to_token_pool=params.req_to_token_pool,
            token_to_kv_pool_allocator=params.token_to_kv_pool_allocator,
            page_size=params.page_size,
            config=config,
            kv_pool=params.kv_pool,
        )
    )

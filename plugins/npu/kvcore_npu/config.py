"""Options of the ``npu`` backend: the radix tree's, with Ascend's page size, on the NPU pools."""

from __future__ import annotations

from pydantic import Field

from kvcore.config import TreeCacheConfig
from kvcore.pool_builder import PoolBuilder

__all__ = ["NpuConfig", "NpuPools"]


class NpuConfig(TreeCacheConfig):
    """The tree options (``eviction_policy``, ``enable_kv_events``, ``disable``) and the pool options,
    with ``page_size`` 128 (SGLang's page size on Ascend).  The pools are the ``npu`` device's
    (:class:`kvcore_npu.NPUPagedTokenToKVPoolAllocator`, :class:`kvcore_npu.NPUMHATokenToKVPool`)
    on whatever torch ``device`` is given: ``"npu"`` on Ascend, ``"cpu"`` for tests."""

    page_size: int = Field(128, gt=0, description="tokens per page (128: SGLang's NPU page size)")


class NpuPools(PoolBuilder[NpuConfig]):
    """The ``npu`` device's pool classes and session rule whatever the torch device (``cpu`` in CI)."""

    device_kind = "npu"

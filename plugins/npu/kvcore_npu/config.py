"""Options of the ``npu`` backend: the radix tree's, with Ascend's page size, on the NPU pools."""

from __future__ import annotations

from pydantic import Field

from kvcore.config import TreeCacheConfig
from kvcore.devices import DeviceSpec, get_device

__all__ = ["NpuConfig"]


class NpuConfig(TreeCacheConfig):
    """The tree options (``eviction_policy``, ``enable_kv_events``, ``disable``) and the pool options,
    with ``page_size`` 128 (SGLang's page size on Ascend).  The pools are the ``npu`` device's
    (:class:`kvcore_npu.NPUPagedTokenToKVPoolAllocator`, :class:`kvcore_npu.NPUMHATokenToKVPool`)
    on whatever torch ``device`` is given: ``"npu"`` on Ascend, ``"cpu"`` for tests."""

    page_size: int = Field(128, gt=0, description="tokens per page (128: SGLang's NPU page size)")

    def pool_device(self) -> DeviceSpec:
        """The NPU pools and session rule whatever the torch device (see :class:`kvcore.CacheConfig`)."""
        return get_device("npu")

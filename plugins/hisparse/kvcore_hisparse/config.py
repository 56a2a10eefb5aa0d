"""Options of the ``hisparse`` backend (SGLang's ``--hisparse-config``: top_k, device_buffer_size,
host_to_device_ratio)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field, model_validator

from kvcore.config import CacheConfig, KvBufferConfig
from kvcore.pool_builder import Placement, PoolBuilder

if TYPE_CHECKING:
    from kvcore_hisparse.memory_pool import HiSparseTokenToKVPool, HiSparseTokenToKVPoolAllocator

__all__ = ["HiSparseConfig", "HiSparsePools", "DEFAULT_KV_SHAPE"]

#: K/V shape when ``kv_buffer`` is not given: small, so the host copy of a long context fits a CPU test.
DEFAULT_KV_SHAPE = KvBufferConfig(num_layers=2, num_heads=1, head_dim=64, dtype="float16")


class HiSparseConfig(CacheConfig):
    """Options of the ``hisparse`` backend.

    ``size`` is the device pool (SGLang's ``size``): per-request buffers of
    ``device_buffer_size`` tokens plus one page, and the KV of prefills until they
    are staged to the host.  The logical pool (what rows hold) and the host pool
    have ``size * host_to_device_ratio`` slots.  K/V bytes always move: their shape
    is ``kv_buffer`` (default: 2 layers, 1 head of 64, float16).
    """

    top_k: int = Field(2048, description="tokens the sparse indexer selects per request and step")
    device_buffer_size: int = Field(4096, description="device buffer tokens per request (plus one page)")
    host_to_device_ratio: int = Field(2, description="logical and host slots per device slot")

    @model_validator(mode="after")
    def _check_hisparse(self) -> HiSparseConfig:
        ps = self.page_size
        if self.host_to_device_ratio < 1:
            raise ValueError(
                f"host_to_device_ratio={self.host_to_device_ratio} must be >= 1: the host holds a full copy "
                "of every token the device pool can hold"
            )
        if self.top_k <= 0:
            raise ValueError(f"top_k must be a positive number of tokens, got {self.top_k}")
        if self.device_buffer_size <= 0 or self.device_buffer_size % ps:
            raise ValueError(
                f"device_buffer_size={self.device_buffer_size} must be a positive multiple of page_size={ps}"
            )
        if self.device_buffer_size < self.top_k:
            raise ValueError(
                f"device_buffer_size={self.device_buffer_size} is smaller than top_k={self.top_k}: one step's "
                "selection must fit in a request's buffer"
            )
        if self.size < self.device_buffer_size + ps:
            raise ValueError(
                f"size={self.size} device slots cannot hold one request's buffer of device_buffer_size + one page "
                f"({self.device_buffer_size + ps})"
            )
        return self

    @property
    def kv_shape(self) -> KvBufferConfig:
        return self.kv_buffer if self.kv_buffer is not None else DEFAULT_KV_SHAPE

    @property
    def logical_size(self) -> int:
        return self.size * self.host_to_device_ratio



class HiSparsePools(PoolBuilder[HiSparseConfig]):
    """The pools of ``hisparse``: the logical/device allocator and the device K/V pool (always built)."""

    def allocator(self, config: HiSparseConfig, at: Placement) -> HiSparseTokenToKVPoolAllocator:
        from kvcore_hisparse.memory_pool import HiSparseTokenToKVPoolAllocator

        return HiSparseTokenToKVPoolAllocator(
            config.size, config.page_size, at.torch_device, host_to_device_ratio=config.host_to_device_ratio
        )

    def kv_pool(self, config: HiSparseConfig, at: Placement) -> HiSparseTokenToKVPool:
        """The device K/V pool: ``size`` slots, written through the logical-to-device map."""
        import torch

        from kvcore_hisparse.memory_pool import HiSparseTokenToKVPool

        kb = config.kv_shape
        return HiSparseTokenToKVPool(
            config.size, config.page_size, getattr(torch, kb.dtype), kb.num_heads, kb.head_dim, kb.num_layers,
            at.torch_device,
        )

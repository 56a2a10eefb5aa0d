"""Validated backend options and what a backend factory receives."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

if TYPE_CHECKING:
    from kvcore.devices import DeviceSpec

__all__ = ["CacheConfig", "TreeCacheConfig", "KvBufferConfig", "CacheInitParams"]


def _device_spec(device: str) -> DeviceSpec:
    from kvcore.devices import get_device

    return get_device(device)


class KvBufferConfig(BaseModel):
    """Shape of the per-layer K/V data buffers (only built when asked for)."""

    model_config = ConfigDict(extra="forbid")

    num_layers: int = Field(2, gt=0)
    num_heads: int = Field(2, gt=0)
    head_dim: int = Field(64, gt=0)
    dtype: Literal["float16", "bfloat16", "float32"] = "float16"


class CacheConfig(BaseModel):
    """The options every backend takes: the pools it runs on.

    A backend with options of its own subclasses this model; ``create_cache``
    validates the caller's keyword arguments against it.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    # strict: a bool (or "4") is refused rather than read as an int.
    size: int = Field(65536, gt=0, strict=True, description="token slots in the KV pool")
    page_size: int = Field(1, gt=0, strict=True, description="tokens per page")
    max_num_reqs: int = Field(256, gt=0, strict=True, description="req_to_token rows")
    pre_alloc_size: int = Field(
        0, ge=0, strict=True, description="disaggregated decode: req_to_token rows for pre-allocated requests on "
        "top of max_num_reqs (a DecodeReqToTokenPool)"
    )
    max_context_len: int = Field(8192, gt=0, strict=True, description="row width: the longest request in tokens")
    device: str = Field(
        "cpu", description="a registered device kind, with an index where it takes one (cpu, cuda, cuda:N, "
        "a plugin's; `kvcore backends` lists them); its defaults (e.g. page_size) apply to options not given"
    )
    kv_buffer: KvBufferConfig | None = Field(None, description="also allocate K/V data buffers of this shape")
    strict: bool = Field(
        True,
        description="validate slots before the cache keeps them (range, allocated, not owned by another node, "
        "no duplicates); False skips these checks for speed",
    )

    @model_validator(mode="before")
    @classmethod
    def _device_defaults(cls, data: Any) -> Any:
        """Options the caller left out take the device's defaults (an unknown device is create_cache's error)."""
        if not isinstance(data, dict):
            return data
        from kvcore.errors import DeviceUnavailable

        device = data.get("device", cls.model_fields["device"].default)
        if not isinstance(device, str):
            return data
        try:
            spec = _device_spec(device)
        except DeviceUnavailable:
            return data
        missing = {k: v for k, v in spec.defaults.items() if k not in data and k in cls.model_fields}
        return {**data, **missing} if missing else data

    @model_validator(mode="after")
    def _check_page_alignment(self):
        if self.size % self.page_size:
            raise ValueError(
                f"size={self.size} is not a multiple of page_size={self.page_size}; "
                f"use a size such as {(self.size // self.page_size + 1) * self.page_size}"
            )
        if self.max_context_len % self.page_size:
            raise ValueError(
                f"max_context_len={self.max_context_len} is not a multiple of page_size={self.page_size}"
            )
        return self

    # The torch device ``device`` resolved to (create_cache sets it; a plugin's kind may map onto another).
    _torch_device: str | None = PrivateAttr(None)

    def torch_device(self) -> str:
        """Where the pools live: the torch device ``device`` resolved to, or ``device`` before create_cache."""
        return self._torch_device or self.device

    # Pools follow the config, so a backend whose pools differ (SWA) overrides these.
    def pool_device(self) -> DeviceSpec:
        """The registered device whose allocator and K/V-pool classes (and session rule) build this
        config's pools: the one ``device`` names.  A backend bound to one family of pools whatever the
        torch device (kvcore-npu's ``npu`` runs the NPU pools on the CPU too) overrides this."""
        return _device_spec(self.device)

    def build_req_to_token_pool(self):
        from kvcore.pools import DecodeReqToTokenPool, ReqToTokenPool

        if self.pre_alloc_size:
            return DecodeReqToTokenPool(
                self.max_num_reqs, self.max_context_len, self.pre_alloc_size, device=self.torch_device()
            )
        return ReqToTokenPool(self.max_num_reqs, self.max_context_len, device=self.torch_device())

    def build_allocator(self):
        from kvcore.pools import TokenToKVPoolAllocator

        cls = self.pool_device().allocator or TokenToKVPoolAllocator
        return cls(self.size, page_size=self.page_size, device=self.torch_device())

    def build_kv_buffer(self):
        if self.kv_buffer is None:
            return None
        import torch

        from kvcore.pools import MHATokenToKVPool

        kb = self.kv_buffer
        cls = self.pool_device().kv_pool or MHATokenToKVPool
        return cls(
            self.size,
            page_size=self.page_size,
            dtype=getattr(torch, kb.dtype),
            head_num=kb.num_heads,
            head_dim=kb.head_dim,
            layer_num=kb.num_layers,
            device=self.torch_device(),
        )


class TreeCacheConfig(CacheConfig):
    """Options of prefix-tree backends."""

    eviction_policy: str = Field("lru", description="lru, lfu, fifo, mru, filo, priority, slru or a plugin's")
    enable_kv_events: bool = Field(False, description="record stored/removed page events for take_events()")
    disable: bool = Field(False, description="match nothing, insert nothing")


@dataclass(slots=True)
class CacheInitParams:
    """What a backend factory is called with: built pools and the validated config."""

    req_to_token_pool: Any
    token_to_kv_pool_allocator: Any
    page_size: int
    config: CacheConfig
    kv_pool: Any = None

    @classmethod
    def from_config(cls, config: CacheConfig) -> CacheInitParams:
        return cls(
            req_to_token_pool=config.build_req_to_token_pool(),
            token_to_kv_pool_allocator=config.build_allocator(),
            page_size=config.page_size,
            config=config,
            kv_pool=config.build_kv_buffer(),
        )

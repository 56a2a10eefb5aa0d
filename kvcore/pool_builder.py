"""How a backend's pools are built: a :class:`Placement` (the resolved device) and a :class:`PoolBuilder`.

A backend's config (:class:`kvcore.CacheConfig`) is plain data: it validates options and
touches no registry.  ``create_cache`` resolves the ``device`` option to a
:class:`Placement` and asks the backend's registered :class:`PoolBuilder` for the pools;
the factory receives them as :class:`kvcore.CacheInitParams`.

The default builder makes kvcore's own pools: a :class:`kvcore.ReqToTokenPool` (a
:class:`kvcore.DecodeReqToTokenPool` when ``pre_alloc_size`` is set), the device's
allocator class (default :class:`kvcore.TokenToKVPoolAllocator`) and, when ``kv_buffer``
is given, the device's K/V pool class (default :class:`kvcore.MHATokenToKVPool`).  A
backend whose pools differ subclasses it, overrides what differs, and registers it::

    class WindowPools(PoolBuilder[WindowConfig]):
        def allocator(self, config: WindowConfig, at: Placement) -> TokenAllocator:
            return SWATokenToKVPoolAllocator(config.size, config.swa_size, config.page_size, at.torch_device)

    register("window", WindowCache, config=WindowConfig, pools=WindowPools())
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Generic, TypeVar

import torch

from kvcore.config import CacheConfig, CacheInitParams

if TYPE_CHECKING:
    from kvcore.devices import DeviceSpec
    from kvcore.pools import MHATokenToKVPool, ReqToTokenPool, TokenAllocator

__all__ = ["Placement", "PoolBuilder", "DEFAULT_POOLS"]

C = TypeVar("C", bound=CacheConfig)


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a cache's pools are built: the device kind whose pool classes and session rule apply
    (:class:`kvcore.devices.DeviceSpec`) and the torch device the ``device`` option resolved to."""

    device: DeviceSpec
    torch_device: torch.device


class PoolBuilder(Generic[C]):
    """Builds the pools of a backend from its validated config at a placement (see the module docstring)."""

    #: Build with this registered device kind's pool classes and session rule whatever ``device`` names
    #: (kvcore-npu's ``npu`` backend runs the NPU pools on ``device="cpu"`` too); None: the kind it names.
    device_kind: ClassVar[str | None] = None

    def req_to_token_pool(self, config: C, at: Placement) -> ReqToTokenPool:
        from kvcore.pools import DecodeReqToTokenPool, ReqToTokenPool

        if config.pre_alloc_size:
            return DecodeReqToTokenPool(
                config.max_num_reqs, config.max_context_len, config.pre_alloc_size, device=at.torch_device
            )
        return ReqToTokenPool(config.max_num_reqs, config.max_context_len, device=at.torch_device)

    def allocator(self, config: C, at: Placement) -> TokenAllocator:
        from kvcore.pools import TokenToKVPoolAllocator

        cls = at.device.allocator or TokenToKVPoolAllocator
        allocator: TokenAllocator = cls(config.size, page_size=config.page_size, device=at.torch_device)
        return allocator

    def kv_pool(self, config: C, at: Placement) -> MHATokenToKVPool | None:
        if config.kv_buffer is None:
            return None
        from kvcore.pools import MHATokenToKVPool

        kb = config.kv_buffer
        cls = at.device.kv_pool or MHATokenToKVPool
        pool: MHATokenToKVPool = cls(
            config.size,
            page_size=config.page_size,
            dtype=getattr(torch, kb.dtype),
            head_num=kb.num_heads,
            head_dim=kb.head_dim,
            layer_num=kb.num_layers,
            device=at.torch_device,
        )
        return pool

    def build(self, config: C, at: Placement) -> CacheInitParams:
        """Every pool, as the factory receives them."""
        return CacheInitParams(
            req_to_token_pool=self.req_to_token_pool(config, at),
            token_to_kv_pool_allocator=self.allocator(config, at),
            page_size=config.page_size,
            config=config,
            kv_pool=self.kv_pool(config, at),
        )


#: The builder of backends that register none: kvcore's own pools on the device's classes.
DEFAULT_POOLS: PoolBuilder[CacheConfig] = PoolBuilder()

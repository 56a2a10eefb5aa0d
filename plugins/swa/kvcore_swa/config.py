"""Options of the SWA backends: the sliding window and the size of the window pool."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from pydantic import Field, field_validator, model_validator

from kvcore.config import CacheConfig
from kvcore.pool_builder import Placement, PoolBuilder
from kvcore.tree.unified_config import UnifiedConfig

if TYPE_CHECKING:
    from kvcore.pools import SWATokenToKVPoolAllocator, TokenAllocator

__all__ = [
    "SWAChunkConfig",
    "SWAConfig",
    "SWAPools",
    "SlidingWindowConfig",
    "check_window",
    "check_window_pool",
    "min_swa_size",
    "require_swa_allocator",
]


def require_swa_allocator(allocator: Any, backend: str) -> SWATokenToKVPoolAllocator:
    """``allocator``, as long as it has a full and a window pool; TypeError otherwise."""
    # What the allocator declares about its pools (PoolView.windowed), not a probe of its methods.
    if not any(view.windowed for view in allocator.pool_views()):
        raise TypeError(
            f"{backend} needs an SWATokenToKVPoolAllocator (full and window pools), "
            f"got {type(allocator).__name__}, whose pools have no window"
        )
    return cast("SWATokenToKVPoolAllocator", allocator)


def min_swa_size(sliding_window_size: int, page_size: int) -> int:
    """The smallest window pool that can run one request: its window plus two pages."""
    return sliding_window_size + 2 * page_size


def check_window(value: int) -> int:
    """``sliding_window_size``, if a positive number of tokens; ValueError otherwise."""
    if value <= 0:
        raise ValueError(f"sliding_window_size must be a positive number of tokens, got {value}")
    return value


def check_window_pool(swa: int, sliding_window_size: int, page_size: int) -> None:
    """ValueError unless a window pool of ``swa`` slots is whole pages and holds one request's window."""
    ps = page_size
    if swa <= 0:
        raise ValueError(f"swa_size must be positive, got {swa}")
    if swa % ps:
        raise ValueError(f"swa_size={swa} is not a multiple of page_size={ps}; use a window pool such as "
                         f"{(swa // ps + 1) * ps}")
    need = min_swa_size(sliding_window_size, ps)
    if swa < need:
        raise ValueError(
            f"swa_size={swa} cannot hold one request's window: sliding_window_size={sliding_window_size} "
            f"plus two pages of {ps} needs at least {need} window slots"
        )


class SlidingWindowConfig(CacheConfig):
    """The common options plus the attention window ``sliding_window_size`` (every SWA backend)."""

    sliding_window_size: int = Field(1024, description="attention window W in tokens")

    @field_validator("sliding_window_size")
    @classmethod
    def _check_window(cls, value: int) -> int:
        return check_window(value)


class SWAChunkConfig(SlidingWindowConfig):
    """Options of the ``swa-chunk`` backend (SGLang's SWAChunkCache): no prefix reuse.

    Every token has a slot in the full pool (``size``) and, while it is inside the
    window, one in the window pool (``swa_size``, default: as large as ``size``).
    """

    swa_size: int | None = Field(None, description="window-pool token slots (default: size)")

    @model_validator(mode="after")
    def _check_swa_pool(self) -> SWAChunkConfig:
        check_window_pool(self.swa_pool_size, self.sliding_window_size, self.page_size)
        return self

    @property
    def swa_pool_size(self) -> int:
        return self.size if self.swa_size is None else self.swa_size


class SWAPools(PoolBuilder[SWAChunkConfig]):
    """The pools of ``swa`` and ``swa-chunk``: a full and a window pool (SWATokenToKVPoolAllocator)."""

    def allocator(self, config: SWAChunkConfig, at: Placement) -> TokenAllocator:
        from kvcore.pools import SWATokenToKVPoolAllocator

        return SWATokenToKVPoolAllocator(config.size, config.swa_pool_size, config.page_size, at.torch_device)


class SWAConfig(UnifiedConfig):
    """Options of the ``swa`` backend: the core's one tree with components (full, swa).

    The window options are the ``swa`` component's (:class:`kvcore_swa.component.SWAOptions`),
    declared here so that generic tools (``kvcore bench``, ``kvcore backends``) see them.
    """

    component_set = ("full", "swa")
    policy_backend = "swa"
    policy_reason = "each component keeps its own LRU order (full and window), as SGLang's UnifiedRadixCache"

    components: tuple[str, ...] = Field(("full", "swa"), description="the component set: ('full', 'swa') only")
    sliding_window_size: int = Field(1024, description="attention window W in tokens")
    swa_size: int | None = Field(None, description="window-pool token slots (default: size)")

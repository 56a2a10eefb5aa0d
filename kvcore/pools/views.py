"""Pools by name: how a backend tells the core which pools it runs on.

Every token allocator and every backend describes its pools as a list of
:class:`PoolView`.  The invariant checker, the bench report (JSON ``pools``),
the plot and the release paths iterate over that list, so a backend with a
pool of a new kind (mamba state slots, a host tier, ...) shows up everywhere
without a core change: it appends its own view in ``BasePrefixCache.pools()``
and reports its cached slots through ``cached_sizes()`` and
``iter_owned_slots()``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from kvcore.record import ReqKvInfo

__all__ = ["PageAllocator", "PoolView", "TokenAllocator"]


class PageAllocator(Protocol):
    """What the core reads of one pool's allocator."""

    page_size: int
    num_pages: int

    def available_size(self) -> int: ...

    def free_slots(self) -> torch.Tensor: ...


@dataclass(frozen=True, slots=True)
class PoolView:
    """One pool a backend runs on.

    ``translate`` maps full-pool slot ids (what req_to_token rows hold) to this
    pool's ids; None means the row holds this pool's ids.  With ``windowed`` a
    running record owns its row's ``[cache_protected_len, kv_allocated_len)``
    except ``[swa_dead_lo, swa_evicted_seqlen)``, which the window free already
    returned.  ``record_slots`` is for pools a row does not index (state slots,
    buffers): it returns the slots a record owns in this pool and their count.
    """

    name: str
    allocator: PageAllocator
    translate: Callable[[torch.Tensor], torch.Tensor] | None = None
    windowed: bool = False
    record_slots: Callable[[ReqKvInfo], tuple[torch.Tensor, int]] | None = None

    @property
    def page_size(self) -> int:
        return int(self.allocator.page_size)

    @property
    def capacity(self) -> int:
        return int(self.allocator.num_pages) * self.page_size

    def available(self) -> int:
        return int(self.allocator.available_size())


class TokenAllocator(Protocol):
    """What a backend, the engine and the release paths call on a token-slot allocator.

    ``kvcore.pools.TokenToKVPoolAllocator`` (one pool) and
    ``SWATokenToKVPoolAllocator`` (full + window) implement it; so can a device's own.
    """

    page_size: int
    device: Any

    def available_size(self) -> int: ...

    def alloc(self, need_size: int) -> torch.Tensor | None: ...

    def alloc_extend(
        self,
        prefix_lens: Any,
        prefix_lens_cpu: Any,
        seq_lens: Any,
        seq_lens_cpu: Any,
        last_loc: Any,
        extend_num_tokens: int,
    ) -> torch.Tensor | None: ...

    def alloc_decode(self, seq_lens: Any, seq_lens_cpu: Any, last_loc: Any) -> torch.Tensor | None: ...

    def free(self, free_index: Any) -> None: ...

    def free_row_segments(
        self, segments: Sequence[tuple[torch.Tensor, int]], *, swa_evicted_seqlen: int = 0, swa_dead_lo: int = 0
    ) -> None: ...

    def pool_views(self) -> list[PoolView]: ...

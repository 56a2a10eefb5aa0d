"""The ownership record of a request's device KV, and the request as the cache sees it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["ReqKvInfo", "Req", "ceil_align", "floor_align"]


def ceil_align(value: int, page_size: int) -> int:
    return -(-value // page_size) * page_size


def floor_align(value: int, page_size: int) -> int:
    return (value // page_size) * page_size


@dataclass(slots=True, kw_only=True)
class ReqKvInfo:
    """Everything a request (or a session slot) owns of the device KV, in one place.

    The request owns ``[cache_protected_len, kv_allocated_len)`` of its req_to_token
    row; the prefix cache owns ``[0, cache_protected_len)``.  Pools, caches and
    sessions read these fields; none of them keeps a second copy.
    """

    # The req_to_token row this record registers; None when it holds no row.
    req_pool_idx: int | None = None
    # The prefix cache owns [0, here): matched or inserted.
    cache_protected_len: int = 0
    kv_committed_len: int = 0
    kv_allocated_len: int = 0
    # [0, here) is never window-evicted (prefill-aware SWA).
    swa_evict_floor: int = 0
    # Window slots in [swa_dead_lo(page), here) were freed while decoding.
    swa_evicted_seqlen: int = 0
    # Backend-specific per-request state (mamba slots, host buffers), keyed by the
    # backend's component name, so a session hand-over moves it with the rest.
    components: dict[str, Any] = field(default_factory=dict)

    def swa_dead_lo(self, page_size: int) -> int:
        """Lowest position whose window slot this record may free itself."""
        lo = max(self.cache_protected_len, self.swa_evict_floor)
        # Round up only above the tree's part: the tree already owns an aligned prefix.
        if page_size > 1 and lo > self.cache_protected_len:
            lo = ceil_align(lo, page_size)
        return lo

    @property
    def is_held(self) -> bool:
        return self.req_pool_idx is not None

    @property
    def is_released(self) -> bool:
        return self.kv_allocated_len == 0 and self.swa_evicted_seqlen == 0

    def mark_released(self) -> None:
        self.kv_allocated_len = 0
        self.swa_evicted_seqlen = 0


_EMPTY_INDICES = torch.empty((0,), dtype=torch.int64)


@dataclass(slots=True, eq=False)
class Req:
    """A request as the KV cache sees it.

    ``fill_ids`` is the prompt followed by the generated tokens; ``kv`` is never
    None.  ``lock`` keeps what ``inc_lock_ref`` returned so that ``dec_lock_ref``
    can give exactly that back.
    """

    rid: str
    origin_input_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    kv: ReqKvInfo = field(default_factory=ReqKvInfo)
    prefix_indices: torch.Tensor = field(default_factory=lambda: _EMPTY_INDICES)
    last_node: Any = None
    lock: Any = None
    extra_key: str | None = None
    session_id: str | None = None
    # Feeds the ``priority`` eviction policy: what this request inserts is kept longer.
    priority: int = 0

    def __post_init__(self) -> None:
        if self.kv is None:
            raise TypeError(f"Req {self.rid!r}: kv must be a ReqKvInfo, not None")
        self.origin_input_ids = list(self.origin_input_ids)
        self.output_ids = list(self.output_ids)

    @property
    def fill_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    @property
    def seqlen(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    def detach_kv(self) -> ReqKvInfo:
        """Hand the record over (to a session slot) and leave a fresh one behind."""
        kv, self.kv = self.kv, ReqKvInfo()
        return kv

    def __repr__(self) -> str:
        return f"Req(rid={self.rid!r}, seqlen={self.seqlen}, kv={self.kv})"

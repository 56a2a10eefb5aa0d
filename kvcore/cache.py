"""The interface every prefix-cache backend implements, and the results it returns."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, NamedTuple

import torch

from kvcore.keys import KeyLike

if TYPE_CHECKING:
    from kvcore.record import Req, ReqKvInfo

__all__ = [
    "BasePrefixCache",
    "MatchResult",
    "InsertResult",
    "EvictResult",
    "LockResult",
    "SlotOwner",
    "free_kv_row_segments",
]


class MatchResult(NamedTuple):
    """What ``match_prefix`` found: the cached slots of the longest cached prefix."""

    device_indices: torch.Tensor
    last_device_node: Any = None
    # Backend extras; -1 / None when the backend has no such notion.
    best_match_node: Any = None
    cache_protected_len: int | None = None
    extras: dict | None = None

    @property
    def prefix_len(self) -> int:
        return int(self.device_indices.numel())


@dataclass(slots=True)
class InsertResult:
    prefix_len: int
    last_device_node: Any = None


@dataclass(slots=True)
class EvictResult:
    num_tokens_evicted: int = 0
    swa_num_tokens_evicted: int = 0


@dataclass(slots=True)
class LockResult:
    """What ``inc_lock_ref`` took; hand it back to ``dec_lock_ref``.

    ``delta`` is the change in protected tokens; ``swa_stop`` marks where a window
    lock stopped (SWA backends), so the unlock stops at the same node.
    """

    delta: int = 0
    swa_stop: Any = None
    extras: dict = field(default_factory=dict)


class SlotOwner(NamedTuple):
    """A set of slots in one pool that one owner (a tree node) holds."""

    pool: str
    owner: str
    slots: torch.Tensor


def free_kv_row_segments(
    allocator, segments: list[tuple[torch.Tensor, int]], *, swa_evicted_seqlen: int, swa_dead_lo: int = 0
) -> None:
    """Free ascending ``(slots, start_pos)`` pieces of one row, split at the SWA cursor.

    Window slots in ``[swa_dead_lo, swa_evicted_seqlen)`` were freed while decoding,
    so only the full side goes back there; elsewhere both sides do.  Positions below
    ``swa_dead_lo`` (a prefill prefix the floor kept out of window eviction) still
    hold their window slots.
    """
    dead: list[torch.Tensor] = []
    alive: list[tuple[torch.Tensor, int]] = []
    for slots, start in segments:
        n = slots.numel()
        if n == 0:
            continue
        lo = min(max(swa_dead_lo - start, 0), n)
        hi = min(max(swa_evicted_seqlen - start, lo), n)
        if lo:
            alive.append((slots[:lo], start))
        if hi > lo:
            dead.append(slots[lo:hi])
        if hi < n:
            alive.append((slots[hi:], start + hi))
    if dead:
        free_full = getattr(allocator, "free_full", None)
        if free_full is None:
            raise ValueError(
                f"row positions below swa_evicted_seqlen={swa_evicted_seqlen} were window-evicted, "
                f"but {type(allocator).__name__} has no window pool"
            )
        if alive and swa_evicted_seqlen % allocator.page_size:
            # A page shared by the dead and alive sides would go back twice.
            raise ValueError(f"SWA cursor {swa_evicted_seqlen} splits a page (page_size {allocator.page_size})")
        free_full(dead[0] if len(dead) == 1 else torch.cat(dead))
    if alive:
        # Piece by piece, in row order: SGLang's page order, so later allocations match.
        free_segments = getattr(allocator, "free_segments", None)
        if free_segments is not None:
            free_segments(alive)
        else:
            allocator.free(alive[0][0] if len(alive) == 1 else torch.cat([slots for slots, _ in alive]))


class BasePrefixCache(ABC):
    """A prefix cache over a req_to_token pool and a token-slot allocator.

    Built backends expose ``req_to_token_pool``, ``token_to_kv_pool_allocator`` and
    ``page_size``.  The per-step calls (match, insert, evict, locks) are plain
    methods; the two lifecycle calls also go through ``self.hook`` so that
    extension plugins can wrap them (see ``kvcore.hookspecs``).
    """

    req_to_token_pool: Any
    token_to_kv_pool_allocator: Any
    page_size: int
    # True where insert() frees the caller's duplicate slots itself (SGLang's SWA tree);
    # otherwise the caller frees value[:prefix_len] after an insert.
    insert_frees_duplicates: bool = False
    # Set by create_cache: this cache's own plugin manager and its hook relay.
    plugin_manager: Any = None
    hook: Any = None

    # -- lookups and updates ------------------------------------------------

    @abstractmethod
    def match_prefix(self, key: KeyLike) -> MatchResult: ...

    @abstractmethod
    def insert(self, key: KeyLike, value: torch.Tensor | None = None) -> InsertResult: ...

    @abstractmethod
    def cache_finished_req(self, req: Req, is_insert: bool = True) -> None:
        """Hand a finished request's committed KV to the cache and drop its lock.

        Frees what the cache does not keep, except the over-allocation past the
        page-aligned committed length, which ``release_kv_cache`` frees.
        """

    @abstractmethod
    def cache_unfinished_req(self, req: Req, chunked: bool = False) -> None:
        """Cache ``fill_ids[:kv_committed_len]`` of a request still running."""

    @abstractmethod
    def evict(self, num_tokens: int) -> EvictResult: ...

    @abstractmethod
    def inc_lock_ref(self, node: Any) -> LockResult: ...

    @abstractmethod
    def dec_lock_ref(self, node: Any, lock: LockResult | None = None) -> LockResult: ...

    # -- sizes --------------------------------------------------------------

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def total_size(self) -> int:
        return self.evictable_size() + self.protected_size()

    def reset(self) -> None:
        """Drop every cached entry (and free its slots)."""

    def take_events(self) -> list:
        return []

    # -- traits -------------------------------------------------------------

    def is_chunk_cache(self) -> bool:
        return False

    def supports_swa(self) -> bool:
        return False

    def swa_retain_floor(self, req: Req) -> int | None:
        return None

    # -- ownership, for the invariant checker ------------------------------

    def cached_sizes(self) -> dict[str, tuple[int, int]]:
        """Per pool: (evictable, protected) slot counts the cache holds."""
        if self.supports_swa():
            return {
                "full": (self.full_evictable_size(), self.full_protected_size()),
                "swa": (self.swa_evictable_size(), self.swa_protected_size()),
            }
        return {"full": (self.evictable_size(), self.protected_size())}

    def iter_owned_slots(self) -> Iterator[SlotOwner]:
        """Every slot the cache itself holds, by pool and owning node."""
        return iter(())

    # -- release ------------------------------------------------------------

    def free_kv_row(self, kv: ReqKvInfo, ranges: list[tuple[int, int]]) -> None:
        """Give back ascending, disjoint ``[start, end)`` position ranges of ``kv``'s row.

        One call frees a page shared by two ranges once.
        """
        row = self.req_to_token_pool.req_to_token[kv.req_pool_idx]
        free_kv_row_segments(
            self.token_to_kv_pool_allocator,
            [(row[s:e].to(torch.int64), s) for s, e in ranges if e > s],
            swa_evicted_seqlen=kv.swa_evicted_seqlen,
            swa_dead_lo=kv.swa_dead_lo(self.page_size),
        )

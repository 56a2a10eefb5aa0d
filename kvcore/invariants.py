"""The invariant checker: proves that no slot leaked and none was freed twice."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from kvcore.errors import InvariantViolation
from kvcore.pools.allocator import TokenToKVPoolAllocator
from kvcore.pools.views import PoolView
from kvcore.record import ceil_align

__all__ = ["InvariantChecker", "PoolReport"]


@dataclass(slots=True)
class PoolReport:
    pool: str
    total: int
    available: int
    evictable: int
    protected: int
    session_held: int
    uncached: int

    @property
    def balanced(self) -> bool:
        return self.available + self.evictable + self.protected + self.session_held + self.uncached == self.total

    def __str__(self) -> str:
        return (
            f"[{self.pool}] total={self.total} available={self.available} evictable={self.evictable} "
            f"protected={self.protected} session_held={self.session_held} uncached={self.uncached}"
        )


def _owner_name(owner: Any) -> str:
    rid = getattr(owner, "rid", None)
    if rid is not None:
        return f"request {rid!r}" if not str(rid).startswith("session ") else str(rid)
    return repr(owner)


class InvariantChecker:
    """Checks a cache and the records alive now against its pools.

    ``check(owners)`` takes the requests and session slots alive now (a
    StreamingSession's own slots are found without being passed) and raises
    InvariantViolation naming the slot and the owner unless, for every pool,
    ``available + evictable + protected + session_held + uncached == total``, every
    record has ``0 <= committed <= allocated <= row width``, no owned slot is in a
    free list and no free list holds a slot twice.
    """

    def __init__(self, cache):
        self.cache = cache

    # -- helpers ---------------------------------------------------------------
    def _records(self, owners: Iterable[Any]) -> tuple[list[tuple[Any, Any]], list[tuple[Any, Any]]]:
        """Distinct records alive now, split into (run by a request) and (held by an idle session slot)."""
        live: dict[int, tuple[Any, Any]] = {}
        idle: dict[int, tuple[Any, Any]] = {}
        slots = list(self.cache.session_slots())
        from kvcore.session import SessionSlot

        for owner in list(owners):
            (idle if isinstance(owner, SessionSlot) else live).setdefault(id(owner.kv), (owner, owner.kv))
        for slot in slots:
            idle.setdefault(id(slot.kv), (slot, slot.kv))
        for key in list(idle):
            if key in live:
                del idle[key]  # a request runs on the slot's record now: count it once, as the request's
        return list(live.values()), list(idle.values())

    # -- the check ---------------------------------------------------------------
    def check(self, owners: Iterable[Any] = ()) -> list[PoolReport]:
        cache = self.cache
        r2t = cache.req_to_token_pool
        width = r2t.max_context_len
        page = cache.page_size
        live, idle = self._records(owners)

        # Rows: every held row is held by one record, free rows are not held.
        free_rows = list(r2t.free_rows())
        if len(set(free_rows)) != len(free_rows):
            dup = next(r for r in free_rows if free_rows.count(r) > 1)
            raise InvariantViolation(f"req_to_token row {dup} is in the free list twice")
        free_row_set = set(free_rows)
        held_rows: dict[int, Any] = {}
        for owner, kv in live + idle:
            name = _owner_name(owner)
            if not kv.is_held:
                # A released record keeps its committed length (SGLang does too); only the pair matters.
                if not kv.is_released:
                    raise InvariantViolation(f"{name}: holds no row but is not released ({kv})")
                continue
            if not (0 <= kv.kv_committed_len <= kv.kv_allocated_len <= width):
                raise InvariantViolation(
                    f"{name}: record out of bounds: committed={kv.kv_committed_len} allocated={kv.kv_allocated_len} "
                    f"row width={width}"
                )
            if kv.cache_protected_len > kv.kv_allocated_len and kv.kv_allocated_len:
                raise InvariantViolation(
                    f"{name}: cache_protected_len={kv.cache_protected_len} > kv_allocated_len={kv.kv_allocated_len}"
                )
            idx = kv.req_pool_idx
            if idx in free_row_set:
                raise InvariantViolation(f"{name} holds req_to_token row {idx}, which is in the free list")
            if idx in held_rows:
                raise InvariantViolation(
                    f"req_to_token row {idx} is held by both {_owner_name(held_rows[idx])} and {name}"
                )
            held_rows[idx] = owner
        if len(free_rows) + len(held_rows) != r2t.size:
            lost = sorted(set(range(1, r2t.size + 1)) - free_row_set - set(held_rows))
            raise InvariantViolation(
                f"req_to_token rows leaked: {lost[:8]} are neither free nor held by any owner passed in"
            )

        sizes = cache.cached_sizes()
        reports = []
        for pool in cache.pools():
            reports.append(self._check_pool(pool, sizes.get(pool.name, (0, 0)), live, idle, page))
        try:
            cache.sanity_check()
        except AssertionError as exc:
            raise InvariantViolation(f"{type(cache).__name__}.sanity_check failed: {exc}") from exc
        return reports

    def _record_slots(self, pool: PoolView, kv, page: int) -> tuple[torch.Tensor, int]:
        """Slots a record owns in ``pool`` (in that pool's ids) and their count for the balance."""
        if pool.record_slots is not None:
            return pool.record_slots(kv)
        row = self.cache.req_to_token_pool.req_to_token[kv.req_pool_idx]
        allocated = ceil_align(kv.kv_allocated_len, page) if page > 1 else kv.kv_allocated_len
        lo = kv.cache_protected_len
        dead_lo = max(lo, kv.swa_dead_lo(page))
        cursor = kv.swa_evicted_seqlen
        if pool.windowed and cursor > dead_lo:
            # [swa_dead_lo, cursor) was freed while decoding; a floor above the tree's
            # prefix keeps [protected, swa_dead_lo) alive.
            slots = torch.cat([row[lo:dead_lo], row[cursor : kv.kv_allocated_len]]).to(torch.int64)
            count = (dead_lo - lo) + max(0, allocated - cursor)
        else:
            slots = row[lo : kv.kv_allocated_len].to(torch.int64)
            count = max(0, allocated - lo)
        if pool.translate is not None and slots.numel():
            slots = pool.translate(slots)
        return slots, count

    def _check_pool(self, pool: PoolView, cached: tuple[int, int], live, idle, row_page: int) -> PoolReport:
        alloc = pool.allocator
        page = pool.page_size
        num_pages = int(alloc.num_pages)
        total = pool.capacity
        free = alloc.free_slots().to(torch.int64).cpu()
        owners: list[tuple[str, torch.Tensor]] = []
        uncached = session_held = 0
        for group, bucket in ((live, "uncached"), (idle, "session")):
            for owner, kv in group:
                if not kv.is_held:
                    continue
                slots, count = self._record_slots(pool, kv, row_page)
                if bucket == "uncached":
                    uncached += count
                else:
                    session_held += count
                owners.append((_owner_name(owner), slots.cpu()))
        try:
            for so in self.cache.iter_owned_slots():
                if so.pool == pool.name:
                    owners.append((so.owner, so.slots.to(torch.int64).cpu()))
        except (IndexError, ValueError) as exc:  # a node's slot id the pools cannot even map
            raise InvariantViolation(f"[{pool.name}] a cached slot lies outside the pool: {exc}") from exc

        report = PoolReport(pool.name, total, int(alloc.available_size()), cached[0], cached[1], session_held, uncached)

        # Ids outside the pool are reported by name before counting (bincount cannot take them).
        limit = (num_pages + 1) * page
        for name, s in [("the free list", free), *owners]:
            if s.numel():
                outside = s[(s < 0) | (s >= limit)]
                if outside.numel():
                    where = "is in the free list" if name == "the free list" else f"is owned by {name}"
                    raise InvariantViolation(
                        f"[{pool.name}] slot {int(outside[0])} {where} but lies outside the pool "
                        f"(slots {page}..{limit - 1})"
                    )
        claimed = pool.allocator.claimed_slots() if isinstance(pool.allocator, TokenToKVPoolAllocator) else None

        # Slot-level proof, in pages: each usable page is free exactly once or owned by exactly one owner.
        free_pages = torch.div(free, page, rounding_mode="floor")
        free_count = torch.bincount(free_pages, minlength=num_pages + 1)
        if page > 1:
            free_count = torch.div(free_count, page, rounding_mode="floor")
        owned = [torch.div(s, page, rounding_mode="floor").unique() for _, s in owners if s.numel()]
        owned_pages = torch.cat(owned) if owned else torch.empty((0,), dtype=torch.int64)
        owned_count = torch.bincount(owned_pages, minlength=num_pages + 1)

        def who(p: int) -> list[str]:
            return [
                name for name, s in owners if s.numel() and bool((torch.div(s, page, rounding_mode="floor") == p).any())
            ]

        def slot_text(p: int) -> str:
            return f"slot {p}" if page == 1 else f"page {p} (slots {p * page}-{p * page + page - 1})"

        if free_count.numel() > num_pages + 1 or owned_count.numel() > num_pages + 1:
            bad = int(torch.cat([free_pages, owned_pages]).max())
            raise InvariantViolation(f"[{pool.name}] {slot_text(bad)} is outside the pool (pages 1..{num_pages})")
        if int(free_count[0]) or int(owned_count[0]):
            names = who(0)
            where = f"owned by {', '.join(names)}" if names else "in the free list"
            raise InvariantViolation(f"[{pool.name}] padding {slot_text(0)} is {where}")
        twice_free = (free_count > 1).nonzero()
        if twice_free.numel():
            p = int(twice_free[0])
            raise InvariantViolation(f"[{pool.name}] {slot_text(p)} is in the free list twice (double free)")
        both = ((free_count > 0) & (owned_count > 0)).nonzero()
        if both.numel():
            p = int(both[0])
            raise InvariantViolation(
                f"[{pool.name}] {slot_text(p)} is in the free list but owned by {', '.join(who(p))} (use after free)"
            )
        shared = (owned_count > 1).nonzero()
        if shared.numel():
            p = int(shared[0])
            raise InvariantViolation(
                f"[{pool.name}] {slot_text(p)} is owned by more than one owner: {', '.join(who(p))}"
            )
        lost = ((free_count == 0) & (owned_count == 0)).nonzero().flatten()
        lost = lost[lost > 0]
        if lost.numel():
            p = int(lost[0])
            raise InvariantViolation(
                f"[{pool.name}] {slot_text(p)} leaked: not in the free list and owned by no node, request or "
                f"session ({lost.numel()} page(s) leaked in all); {report}"
            )
        if not report.balanced:
            raise InvariantViolation(f"[{pool.name}] pool does not balance: {report}")
        if claimed is not None and claimed.numel():
            # A slot a tree claimed (strict mode) must still be one its nodes hold.
            tree = [so.slots.to(torch.int64).cpu() for so in self.cache.iter_owned_slots() if so.pool == pool.name]
            held = torch.zeros(limit, dtype=torch.bool)
            if tree:
                held[torch.cat(tree)] = True
            stale = claimed.cpu()[~held[claimed.cpu()]]
            if stale.numel():
                raise InvariantViolation(
                    f"[{pool.name}] slot {int(stale[0])} is claimed by the cache in the allocator but no node "
                    f"holds it ({stale.numel()} such slot(s))"
                )
        return report

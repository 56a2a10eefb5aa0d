"""The invariant checker: proves that no slot leaked and none was freed twice."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvcore.errors import InvariantViolation
from kvcore.pools.allocator import TokenToKVPoolAllocator
from kvcore.pools.views import PoolView
from kvcore.record import ceil_align

if TYPE_CHECKING:
    from kvcore.cache import BasePrefixCache
    from kvcore.record import ReqKvInfo

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


def _imbalance(report: PoolReport, node_held: int, free_slots: int) -> str:
    """Which side of ``report`` is over and by how much, and the count that disagrees with the slots."""
    r = report
    parts = r.available + r.evictable + r.protected + r.session_held + r.uncached
    diff = parts - r.total
    out = (f"available + evictable + protected + session_held + uncached = {r.available} + {r.evictable} + "
           f"{r.protected} + {r.session_held} + {r.uncached} = {parts}, {abs(diff)} "
           f"{'more' if diff > 0 else 'fewer'} than total={r.total}")
    # Every slot was found free or owned exactly once, so one of the reported counts is off.
    cached = r.evictable + r.protected
    if cached != node_held:
        out += (f"; the cache reports {cached} cached token(s) (evictable + protected) but its nodes hold "
                f"{node_held} slot(s): its size counters are {abs(cached - node_held)} too "
                f"{'high' if cached > node_held else 'low'}")
    elif r.available != free_slots:
        off = r.available - free_slots
        out += (f"; the allocator reports available={r.available} but its free list holds {free_slots} slot(s): "
                f"available_size() is {abs(off)} too {'high' if off > 0 else 'low'}")
    return f"{out}; {r}"


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

    def __init__(self, cache: BasePrefixCache) -> None:
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
        if len(free_rows) + len(held_rows) != r2t.num_rows:
            lost = sorted(set(range(1, r2t.num_rows + 1)) - free_row_set - set(held_rows))
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

    def _record_slots(self, pool: PoolView, kv: ReqKvInfo, page: int) -> tuple[torch.Tensor, int]:
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

    def _owned(
        self, pool: PoolView, live: list[tuple[Any, Any]], idle: list[tuple[Any, Any]], row_page: int
    ) -> Iterator[tuple[str, torch.Tensor, str, int]]:
        """Every owner of slots in ``pool``, one at a time: (name, slots as int64 on the CPU, bucket, count).

        Records first (bucket ``uncached`` or ``session``), then the cache's own
        nodes (bucket ``cache``, count 0).  Nothing is kept: the check streams over
        it and walks it again only to name the owners of a page found wrong.
        """
        for group, bucket in ((live, "uncached"), (idle, "session")):
            for owner, kv in group:
                # A pool a row does not index (state slots) may be held before any row: SGLang's scheduler
                # gives a request its Mamba state slot at the admission match, before its KV.
                if kv.is_held or pool.record_slots is not None:
                    slots, count = self._record_slots(pool, kv, row_page)
                    yield _owner_name(owner), slots.to(torch.int64).cpu(), bucket, count
        try:
            for so in self.cache.iter_owned_slots():
                if so.pool == pool.name:
                    yield so.owner, so.slots.to(torch.int64).cpu(), "cache", 0
        except (IndexError, ValueError) as exc:  # a node's slot id the pools cannot even map
            raise InvariantViolation(f"[{pool.name}] a cached slot lies outside the pool: {exc}") from exc

    def _check_pool(self, pool: PoolView, cached: tuple[int, int], live: list[tuple[Any, Any]],
                    idle: list[tuple[Any, Any]], row_page: int) -> PoolReport:
        """Slot-level proof, in pages: each usable page is free exactly once or owned by exactly one owner.

        Memory is one int32 count per page (the free list is read as the
        allocator hands it out; owners stream through in chunks), so checking an
        8M-slot pool costs about 4 bytes a page on top of the free list.  Per page
        the count holds ``free + 2 * owners`` (free: 0 or 1, a double free is
        noted before the owners are counted), so a sound page holds 1 or 2.
        """
        alloc = pool.allocator
        page = pool.page_size
        num_pages = int(alloc.num_pages)
        total = pool.capacity
        limit = (num_pages + 1) * page

        def slot_text(p: int) -> str:
            return f"slot {p}" if page == 1 else f"page {p} (slots {p * page}-{p * page + page - 1})"

        def outside(s: torch.Tensor, where: str) -> None:
            # Ids outside the pool are reported by name before counting (index_add_ cannot take them).
            if s.numel() and (int(s.min()) < 0 or int(s.max()) >= limit):
                bad = s[(s < 0) | (s >= limit)]
                raise InvariantViolation(
                    f"[{pool.name}] slot {int(bad[0])} {where} but lies outside the pool (slots {page}..{limit - 1})"
                )

        cnt = torch.zeros(num_pages + 1, dtype=torch.int32)
        one = torch.ones(1, dtype=torch.int32)

        # 1. The free list: slots per page, then 0/1 per page once a double free is noted.
        free = alloc.free_slots()
        free = free.cpu() if free.dtype == torch.int64 else free.to(torch.int64).cpu()
        outside(free, "is in the free list")
        n_free = int(free.numel())
        for i in range(0, free.numel(), _CHUNK):
            c = free[i : i + _CHUNK]
            if page > 1:
                c = torch.div(c, page, rounding_mode="floor")
            cnt.index_add_(0, c, one.expand(c.numel()))
        del free
        if page > 1:
            cnt.floor_divide_(page)  # a page is free when all its slots are
        twice_free = _first(cnt, lambda c: c > 1)
        cnt.clamp_(max=1)

        # 2. The owners: 2 per distinct page each owner holds, in chunks of about _CHUNK slots.
        uncached = session_held = node_held = 0
        pending: list[torch.Tensor] = []
        queued = 0
        for name, slots, bucket, count in self._owned(pool, live, idle, row_page):
            if bucket == "uncached":
                uncached += count
            elif bucket == "session":
                session_held += count
            else:
                node_held += int(slots.numel())
            if not slots.numel():
                continue
            outside(slots, f"is owned by {name}")
            pages = torch.div(slots, page, rounding_mode="floor") if page > 1 else slots
            pending.append(pages.unique())
            queued += pending[-1].numel()
            if queued >= _CHUNK:
                c = torch.cat(pending) if len(pending) > 1 else pending[0]
                cnt.index_add_(0, c, one.expand(c.numel()), alpha=2)
                pending, queued = [], 0
        if pending:
            c = torch.cat(pending) if len(pending) > 1 else pending[0]
            cnt.index_add_(0, c, one.expand(c.numel()), alpha=2)
        del pending

        report = PoolReport(pool.name, total, int(alloc.available_size()), cached[0], cached[1], session_held, uncached)

        def who(p: int) -> list[str]:
            return [
                name
                for name, s, _, _ in self._owned(pool, live, idle, row_page)
                if s.numel() and bool((torch.div(s, page, rounding_mode="floor") == p).any())
            ]

        if int(cnt[0]):
            names = who(0)
            where = f"owned by {', '.join(names)}" if names else "in the free list"
            raise InvariantViolation(f"[{pool.name}] padding {slot_text(0)} is {where}")
        if twice_free is not None:
            raise InvariantViolation(f"[{pool.name}] {slot_text(twice_free)} is in the free list twice (double free)")
        if _first(cnt, lambda c: (c < 1) | (c > 2), start=1) is not None:
            # Something is wrong: name the first page of the first kind, as a reader expects.
            p = _first(cnt, lambda c: (c >= 3) & (c % 2 == 1), start=1)
            if p is not None:
                raise InvariantViolation(
                    f"[{pool.name}] {slot_text(p)} is in the free list but owned by {', '.join(who(p))} "
                    "(use after free)"
                )
            p = _first(cnt, lambda c: c >= 4, start=1)
            if p is not None:
                raise InvariantViolation(
                    f"[{pool.name}] {slot_text(p)} is owned by more than one owner: {', '.join(who(p))}"
                )
            lost = int((cnt[1:] == 0).sum())
            p = _first(cnt, lambda c: c == 0, start=1)
            assert p is not None  # a page below 1 that is not 0: the only kind left
            hint = ""
            if node_held < cached[0] + cached[1]:
                # The usual author's bug: the tree holds the slots but does not say so.
                hint = (
                    f"; the cache counts {cached[0] + cached[1]} cached token(s) in this pool but its "
                    f"iter_owned_slots() yielded {node_held} slot(s): a backend's iter_owned_slots() must yield a "
                    "kvcore.SlotOwner for every slot its nodes hold"
                )
            raise InvariantViolation(
                f"[{pool.name}] {slot_text(p)} leaked: not in the free list and owned by no node, request or "
                f"session ({lost} page(s) leaked in all); {report}{hint}"
            )
        del cnt
        if not report.balanced:
            raise InvariantViolation(f"[{pool.name}] pool does not balance: {_imbalance(report, node_held, n_free)}")
        claimed = alloc.claimed_slots() if isinstance(alloc, TokenToKVPoolAllocator) else None
        if claimed is not None and claimed.numel():
            # A slot a tree claimed (strict mode) must still be one its nodes hold.
            held = torch.zeros(limit, dtype=torch.bool)
            for so in self.cache.iter_owned_slots():
                if so.pool == pool.name:
                    held.index_fill_(0, so.slots.to(torch.int64).cpu(), True)
            claimed = claimed.cpu()
            stale = [c[~held[c]] for c in claimed.split(_CHUNK)]
            n_stale = sum(int(c.numel()) for c in stale)
            if n_stale:
                first = next(int(c[0]) for c in stale if c.numel())
                raise InvariantViolation(
                    f"[{pool.name}] slot {first} is claimed by the cache in the allocator but no node "
                    f"holds it ({n_stale} such slot(s))"
                )
        return report


# Slots (or pages) handled per step: bounds the checker's temporaries on large pools.
_CHUNK = 1 << 20


def _first(cnt: torch.Tensor, bad: Callable[[torch.Tensor], torch.Tensor], start: int = 0) -> int | None:
    """The first index ``>= start`` of ``cnt`` where ``bad`` holds, read in chunks; None if there is none."""
    for i in range(start, cnt.numel(), _CHUNK):
        hit = bad(cnt[i : i + _CHUNK]).nonzero()
        if hit.numel():
            return i + int(hit[0])
    return None

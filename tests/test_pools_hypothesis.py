"""Random alloc/free sequences over the pools, checked against plain-list models of SGLang's free lists.

Request rows: row 0 is padding, rows 1..size start free as [1..size]; the list is a
stack (alloc takes the tail, free appends).  Token slots: alloc takes the front;
freed slots go to the back when page_size == 1, freed pages (unique, ascending)
to the front when paged.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvcore.pools import ReqToTokenPool, SWATokenToKVPoolAllocator, TokenToKVPoolAllocator
from kvcore.record import ReqKvInfo

ROWS, SIZE, SIZE_SWA = 4, 32, 16


class Owner:
    def __init__(self, rid: int) -> None:
        self.rid = rid
        self.kv = ReqKvInfo()


class RefPages:
    """The token free list as SGLang keeps it with need_sort=False (back when p == 1, front when paged)."""

    def __init__(self, size: int, p: int) -> None:
        self.p = p
        self.pages = list(range(1, size // p + 1))

    def take(self, k: int) -> list[int]:
        out, self.pages = self.pages[:k], self.pages[k:]
        return out

    def give(self, slots: list[int]) -> None:
        if self.p == 1:
            self.pages = self.pages + slots
        else:
            self.pages = sorted({s // self.p for s in slots}) + self.pages

    def slots(self) -> list[int]:
        return [pg * self.p + o for pg in self.pages for o in range(self.p)]


def expand(pages: list[int], p: int) -> list[int]:
    return [pg * p + o for pg in pages for o in range(p)]


class PoolMachine(RuleBasedStateMachine):
    P = 1

    def __init__(self) -> None:
        super().__init__()
        p = self.P
        self.rows = ReqToTokenPool(ROWS, 8)
        self.ref_rows = list(range(1, ROWS + 1))  # row 0 is padding; a stack, taken from the tail
        self.owners = [Owner(i) for i in range(6)]
        self.alloc = TokenToKVPoolAllocator(SIZE, p)
        self.ref = RefPages(SIZE, p)
        self.held: list[int] = []  # pages
        self.swa = SWATokenToKVPoolAllocator(SIZE, SIZE_SWA, p)
        self.ref_full = RefPages(SIZE, p)
        self.ref_win = RefPages(SIZE_SWA, p)
        self.swa_held: list[int] = []  # full pages
        self.win: dict[int, int] = {}  # full slot -> window slot, live ones only

    # ---- ReqToTokenPool ----

    @rule(data=st.data())
    def alloc_rows(self, data: st.DataObject) -> None:
        reqs = data.draw(st.lists(st.sampled_from(self.owners), max_size=4))
        need = list(dict.fromkeys(r for r in reqs if r.kv.req_pool_idx is None))
        got = self.rows.alloc(reqs)
        if len(need) > len(self.ref_rows):
            assert got is None and all(r.kv.req_pool_idx is None for r in need)
            return
        if need:
            # The last len(need) free rows, assigned in request order.
            take = self.ref_rows[-len(need):]
            del self.ref_rows[-len(need):]
            assert [r.kv.req_pool_idx for r in need] == take
        assert got == [r.kv.req_pool_idx for r in reqs]
        for r in need:
            r.kv.kv_allocated_len = 1  # what the engine does next: a reused row must carry allocated KV

    @rule(data=st.data())
    def free_row(self, data: st.DataObject) -> None:
        o = data.draw(st.sampled_from(self.owners))
        row = o.kv.req_pool_idx
        if row is None:
            with pytest.raises(ValueError, match="holds no"):
                self.rows.free(o)
            return
        self.rows.free(o)
        o.kv.kv_allocated_len = 0
        self.ref_rows.append(row)
        assert o.kv.req_pool_idx is None

    # ---- TokenToKVPoolAllocator ----

    @rule(k=st.integers(0, 12))
    def alloc_slots(self, k: int) -> None:
        p = self.P
        got = self.alloc.alloc(k * p)
        if k > len(self.ref.pages):
            assert got is None
            return
        pages = self.ref.take(k)
        assert got.tolist() == expand(pages, p)
        self.held += pages

    @rule(seqs=st.lists(st.integers(0, 9), min_size=1, max_size=3))
    def alloc_extend_fresh(self, seqs: list[int]) -> None:
        p = self.P
        n = len(seqs)
        got = self.alloc.alloc_extend(
            torch.zeros(n, dtype=torch.int64), [0] * n, torch.tensor(seqs), seqs, torch.full((n,), -1), sum(seqs)
        )
        need = sum(-(-s // p) for s in seqs)
        if need > len(self.ref.pages):
            assert got is None
            return
        pages = self.ref.take(need)
        it = iter(pages)  # requests take new pages in batch order
        want = []
        for s in seqs:
            for pos in range(s):
                if pos % p == 0:
                    base = next(it) * p
                want.append(base + pos % p)
        assert got.tolist() == want
        self.held += pages

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free_slots(self, data: st.DataObject) -> None:
        p = self.P
        pages = data.draw(st.lists(st.sampled_from(self.held), min_size=1, unique=True))
        # Paged frees may name any slots of a page, several times.
        slots = [pg * p + data.draw(st.integers(0, p - 1)) for pg in pages for _ in range(1 if p == 1 else 2)]
        self.alloc.free(slots)
        self.ref.give(slots)
        self.held = [pg for pg in self.held if pg not in pages]

    @rule(data=st.data())
    def double_free(self, data: st.DataObject) -> None:
        p = self.P
        before = (self.alloc.available_size(), self.alloc.free_slots().tolist())
        choices = [0, SIZE + p] + (self.ref.slots() if self.ref.pages else [])
        bad = data.draw(st.sampled_from(choices))
        extra = [self.held[0] * p] if self.held else []
        with pytest.raises(ValueError):
            self.alloc.free(extra + [bad])
        if p == 1 and self.held:
            with pytest.raises(ValueError, match="twice"):
                self.alloc.free([self.held[0], self.held[0]])
        assert (self.alloc.available_size(), self.alloc.free_slots().tolist()) == before

    # ---- SWATokenToKVPoolAllocator ----

    @rule(k=st.integers(0, 6))
    def swa_alloc(self, k: int) -> None:
        p = self.P
        got = self.swa.alloc(k * p)
        if k > len(self.ref_full.pages) or k > len(self.ref_win.pages):
            assert got is None
            return
        full, win = self.ref_full.take(k), self.ref_win.take(k)
        assert got.tolist() == expand(full, p)
        self.win.update(zip(expand(full, p), expand(win, p)))
        self.swa_held += full

    def _draw_full(self, data: st.DataObject) -> tuple[list[int], list[int]]:
        p = self.P
        pages = data.draw(st.lists(st.sampled_from(self.swa_held), min_size=1, unique=True))
        return pages, [pg * p + data.draw(st.integers(0, p - 1)) for pg in pages]

    def _drop_window(self, pages: list[int]) -> None:
        p = self.P
        order = expand(pages if p == 1 else sorted(pages), p)
        self.ref_win.give([self.win.pop(s) for s in order if s in self.win])

    @precondition(lambda self: self.swa_held)
    @rule(data=st.data())
    def swa_free(self, data: st.DataObject) -> None:
        pages, slots = self._draw_full(data)
        self.swa.free(slots)
        self.ref_full.give(slots)
        self._drop_window(pages)
        self.swa_held = [pg for pg in self.swa_held if pg not in pages]

    @precondition(lambda self: self.swa_held)
    @rule(data=st.data())
    def swa_free_swa(self, data: st.DataObject) -> None:
        pages, slots = self._draw_full(data)
        self.swa.free_swa(slots)
        self._drop_window(pages)

    @precondition(lambda self: self.swa_held)
    @rule(data=st.data())
    def swa_free_full_of_dead(self, data: st.DataObject) -> None:
        p = self.P
        dead = [pg for pg in self.swa_held if all(s not in self.win for s in expand([pg], p))]
        if not dead:
            return
        pages = data.draw(st.lists(st.sampled_from(dead), min_size=1, unique=True))
        slots = expand(pages, p)
        self.swa.free_full(slots)
        self.ref_full.give(slots)
        self.swa_held = [pg for pg in self.swa_held if pg not in pages]

    @rule(data=st.data())
    def swa_double_free(self, data: st.DataObject) -> None:
        if not self.ref_full.pages:
            return
        before = self._swa_state()
        bad = data.draw(st.sampled_from(self.ref_full.slots()))
        with pytest.raises(ValueError, match="already free"):
            data.draw(st.sampled_from([self.swa.free, self.swa.free_full]))([bad])
        assert self._swa_state() == before

    @precondition(lambda self: len(self.swa_held) >= 2)
    @rule(data=st.data())
    def swa_group(self, data: st.DataObject) -> None:
        # Inside a group nothing returns to a free list until the end.
        p = self.P
        a, b = data.draw(st.lists(st.sampled_from(self.swa_held), min_size=2, max_size=2, unique=True))
        before = self._swa_state()
        self.swa.free_group_begin()
        self.swa.free_swa(expand([a], p))
        self.swa.free(expand([b], p))
        assert self._swa_state() == before
        self.swa.free_group_end()
        # free_swa's window slots were resolved first, then free() ran at the end.
        a_win = [self.win.pop(s) for s in expand([a], p) if s in self.win]
        self.ref_full.give(expand([b], p))
        b_win = [self.win.pop(s) for s in expand([b], p) if s in self.win]
        self.ref_win.give(b_win)
        self.ref_win.give(a_win)
        self.swa_held.remove(b)

    # ---- invariants ----

    def _swa_state(self) -> tuple:
        return (
            self.swa.full_available_size(),
            self.swa.swa_available_size(),
            self.swa.full_free_slots().tolist(),
            self.swa.swa_free_slots().tolist(),
        )

    @invariant()
    def rows_conserved(self) -> None:
        held = [o.kv.req_pool_idx for o in self.owners if o.kv.req_pool_idx is not None]
        free = self.rows.free_rows()
        assert free == self.ref_rows
        assert len(set(free)) == len(free) and not set(free) & set(held)
        assert len(set(held)) == len(held) and set(free) | set(held) == set(range(1, ROWS + 1))
        assert self.rows.available_size() + len(held) == ROWS

    @invariant()
    def slots_conserved(self) -> None:
        p = self.P
        free = self.alloc.free_slots().tolist()
        assert free == self.ref.slots()
        held = set(expand(self.held, p))
        assert len(set(free)) == len(free) and not set(free) & held
        assert self.alloc.available_size() + len(held) == SIZE

    @invariant()
    def swa_conserved(self) -> None:
        p = self.P
        full_free = self.swa.full_free_slots().tolist()
        win_free = self.swa.swa_free_slots().tolist()
        assert full_free == self.ref_full.slots() and win_free == self.ref_win.slots()
        held = set(expand(self.swa_held, p))
        assert len(set(full_free)) == len(full_free) and not set(full_free) & held
        assert len(set(win_free)) == len(win_free) and not set(win_free) & set(self.win.values())
        assert self.swa.full_available_size() + len(held) == SIZE
        assert self.swa.swa_available_size() + len(self.win) == SIZE_SWA
        mapping = self.swa.full_to_swa_index_mapping.tolist()
        assert {i: w for i, w in enumerate(mapping) if w} == self.win


class PagedPoolMachine(PoolMachine):
    P = 4


_settings = settings(
    max_examples=50, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestPools = PoolMachine.TestCase
TestPools.settings = _settings
TestPagedPools = PagedPoolMachine.TestCase
TestPagedPools.settings = _settings

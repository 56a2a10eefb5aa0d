"""Pools: request rows, token-slot allocators (plain, paged, SWA) and KV buffers."""

from __future__ import annotations

import random

import pytest
import torch

from kvcore.pools import (
    MHATokenToKVPool,
    ReqToTokenPool,
    SWATokenToKVPoolAllocator,
    TokenToKVPoolAllocator,
)
from kvcore.record import ReqKvInfo


class Owner:
    def __init__(self, rid: str, idx: int | None = None) -> None:
        self.rid = rid
        self.kv = ReqKvInfo(req_pool_idx=idx)


class RefFreeList:
    """SGLang's need_sort=False free list as a plain list of pages.

    Alloc takes from the front.  Freed slots go to the back when page_size == 1
    (``TokenToKVPoolAllocator.free``); freed pages, unique and ascending, go to the
    front when paged (``PagedTokenToKVPoolAllocator._release_page_ids``).
    """

    def __init__(self, size: int, p: int) -> None:
        self.p = p
        self.pages = list(range(1, size // p + 1))

    def alloc(self, n: int) -> list[int] | None:
        k = n // self.p
        if k > len(self.pages):
            return None
        out, self.pages = self.pages[:k], self.pages[k:]
        return [pg * self.p + o for pg in out for o in range(self.p)]

    def free(self, slots: list[int]) -> None:
        if self.p == 1:
            self.pages = self.pages + slots
        else:
            self.pages = sorted({s // self.p for s in slots}) + self.pages

    def slots(self) -> list[int]:
        return [pg * self.p + o for pg in self.pages for o in range(self.p)]


def ref_paged(pages: list[int], p: int, prefix: list[int], seq: list[int], last: list[int]) -> list[int] | None:
    """SGLang's paged rule, token by token: continue after last_loc, open a new page at each boundary."""
    need = sum(-(-s // p) - -(-q // p) for q, s in zip(prefix, seq))
    if need > len(pages):
        return None
    it = iter(pages[:need])
    out: list[int] = []
    for q, s, cur in zip(prefix, seq, last):
        for pos in range(q, s):
            cur = next(it) * p if pos % p == 0 else cur + 1
            out.append(cur)
    del pages[:need]
    return out


def state(a: TokenToKVPoolAllocator) -> tuple[int, list[int]]:
    return a.available_size(), a.free_slots().tolist()


# ---- ReqToTokenPool ---------------------------------------------------------


def test_req_pool_shape_and_stack_rows() -> None:
    pool = ReqToTokenPool(3, 8)
    # Row 0 is padding: size + 1 rows, rows 1..size usable, free list starts [1..size].
    assert pool.req_to_token.shape == (4, 8) and pool.req_to_token.dtype == torch.int32
    assert (pool.size, pool.max_context_len, pool.device) == (3, 8, "cpu")
    assert pool.free_rows() == [1, 2, 3] and pool.available_size() == 3
    a, b, c = Owner("a"), Owner("b"), Owner("c")
    # A stack: the last two free rows, handed out in request order.
    assert pool.alloc([a, b]) == [2, 3]
    assert pool.free_rows() == [1]
    pool.free(a)
    assert a.kv.req_pool_idx is None and pool.free_rows() == [1, 2]
    b.kv.kv_allocated_len = 4  # a reused row must carry allocated KV (SGLang's check)
    assert pool.alloc([c, b]) == [2, 3]  # b keeps its row; c takes the row freed last
    assert pool.free_rows() == [1] and pool.available_size() == 1
    assert pool.alloc([a]) == [1] and pool.available_size() == 0
    assert pool.free_rows() == []
    assert pool.alloc([Owner("d")]) is None


def test_req_pool_alloc_short_changes_nothing() -> None:
    pool = ReqToTokenPool(2, 4)
    a, b, c = Owner("a"), Owner("b"), Owner("c")
    assert pool.alloc([a]) == [2]
    assert pool.alloc([b, c]) is None
    assert b.kv.req_pool_idx is None and c.kv.req_pool_idx is None
    assert pool.free_rows() == [1]
    a.kv.kv_allocated_len = 3  # a reused row must carry allocated KV
    assert pool.alloc([a, b]) == [2, 1]  # held rows need no free row
    assert pool.alloc([]) == [] and pool.free_rows() == []


def test_req_pool_same_record_twice_gets_one_row() -> None:
    pool = ReqToTokenPool(2, 4)
    a = Owner("a")
    assert pool.alloc([a, a]) == [2, 2]
    assert pool.available_size() == 1 and pool.free_rows() == [1]


def test_req_pool_free_errors() -> None:
    pool = ReqToTokenPool(2, 4)
    a = Owner("a")
    with pytest.raises(ValueError, match="'a' holds no"):
        pool.free(a)
    pool.alloc([a])
    stale = Owner("stale", idx=a.kv.req_pool_idx)
    pool.free(a)
    with pytest.raises(ValueError, match="row 2 of request 'stale' is already free"):
        pool.free(stale)
    with pytest.raises(ValueError, match="outside"):
        pool.free(Owner("x", idx=7))
    with pytest.raises(ValueError, match="outside"):
        pool.free(Owner("x", idx=3))  # one past the last usable row
    with pytest.raises(ValueError, match="holds row 0, outside"):
        pool.free(Owner("pad", idx=0))  # the padding row is never handed out
    assert pool.free_rows() == [1, 2] and stale.kv.req_pool_idx == 2


def test_req_pool_write_and_clear() -> None:
    pool = ReqToTokenPool(2, 4)
    a = Owner("a")
    assert pool.alloc([a]) == [2]
    pool.write((2, slice(0, 3)), torch.tensor([5, 6, 7], dtype=torch.int32))
    assert pool.req_to_token[2].tolist() == [5, 6, 7, 0]
    assert pool.req_to_token[[0, 1]].abs().sum() == 0  # padding row and free row untouched
    pool.clear()
    assert pool.free_rows() == [1, 2] and pool.available_size() == 2


# ---- TokenToKVPoolAllocator: construction, alloc ---------------------------


@pytest.mark.parametrize("size,p", [(0, 1), (-4, 1), (10, 4), (8, 0)])
def test_allocator_bad_size(size: int, p: int) -> None:
    with pytest.raises(ValueError, match="size"):
        TokenToKVPoolAllocator(size, p)


@pytest.mark.parametrize("p", [1, 4])
def test_allocator_initial_state(p: int) -> None:
    a = TokenToKVPoolAllocator(16, p, device=torch.device("cpu"))
    assert (a.size, a.page_size, a.num_pages) == (16, p, 16 // p)
    assert a.available_size() == 16
    assert a.free_slots().tolist() == list(range(p, 16 + p))
    assert a.free_slots().dtype == torch.int64


@pytest.mark.parametrize("p", [1, 4])
def test_alloc_whole_pages_and_short(p: int) -> None:
    a = TokenToKVPoolAllocator(16, p)
    x = a.alloc(8)
    assert x.dtype == torch.int64 and x.tolist() == list(range(p, p + 8))
    before = state(a)
    assert a.alloc(12) is None
    assert state(a) == before
    assert a.alloc(0).numel() == 0 and state(a) == before
    assert a.alloc(8).tolist() == list(range(p + 8, p + 16))
    assert a.available_size() == 0 and a.alloc(p) is None


def test_alloc_bad_sizes_change_nothing() -> None:
    a = TokenToKVPoolAllocator(16, 4)
    before = state(a)
    with pytest.raises(ValueError, match="multiple of page_size"):
        a.alloc(3)
    with pytest.raises(ValueError, match=">= 0"):
        a.alloc(-4)
    assert state(a) == before


# ---- free: order and errors -------------------------------------------------


@pytest.mark.parametrize("p", [1, 4])
def test_free_order_back_or_front(p: int) -> None:
    a, ref = TokenToKVPoolAllocator(16, p), RefFreeList(16, p)
    x = a.alloc(12)
    assert x.tolist() == ref.alloc(12)
    back = x[[5, 0, 9]] if p == 1 else x[[9, 0, 1]]
    a.free(back)
    ref.free(back.tolist())
    assert a.free_slots().tolist() == ref.slots()
    if p == 1:
        # Slots go to the back in the order given.
        assert a.free_slots().tolist() == [13, 14, 15, 16, 6, 1, 10]
    else:
        # Pages 3 and 1 go to the front, unique and ascending, ahead of free page 4.
        assert a.free_slots().tolist() == [4, 5, 6, 7, 12, 13, 14, 15, 16, 17, 18, 19]
    got = a.alloc(4)
    assert got.tolist() == ref.alloc(4) == ([13, 14, 15, 16] if p == 1 else [4, 5, 6, 7])
    assert a.free_slots().tolist() == ref.slots()


def test_free_accepts_lists_and_int_dtypes() -> None:
    a = TokenToKVPoolAllocator(8)
    a.alloc(8)
    a.free([3, 1])
    a.free(torch.tensor([2], dtype=torch.int32))
    a.free(torch.tensor([[4, 5]], dtype=torch.int16))
    a.free([])
    a.free(torch.empty(0, dtype=torch.int64))
    assert a.free_slots().tolist() == [3, 1, 2, 4, 5]
    with pytest.raises(ValueError, match="integers"):
        a.free(torch.tensor([6.0]))


def test_paged_free_gives_back_whole_pages() -> None:
    a = TokenToKVPoolAllocator(16, 4)
    a.alloc(16)
    # A partial page and slots of one page twice: unique pages, ascending, as SGLang.
    a.free(torch.tensor([13, 5, 6, 14]))
    assert a.free_slots().tolist() == [4, 5, 6, 7, 12, 13, 14, 15]
    assert a.available_size() == 8
    # A later free goes in front of those.
    a.free(torch.tensor([18, 9]))
    assert a.free_slots().tolist() == [8, 9, 10, 11, 16, 17, 18, 19, 4, 5, 6, 7, 12, 13, 14, 15]
    assert a.alloc(8).tolist() == [8, 9, 10, 11, 16, 17, 18, 19]


@pytest.mark.parametrize(
    "p,bad,msg",
    [
        (1, [0], "slot 0 is padding"),
        (1, [17], "slot 17 is padding or out of range"),
        (1, [-1], "slot -1"),
        (1, [3, 5, 3], "slot 3 appears twice"),
        (1, [2, 9], "slot 9 is already free"),
        (4, [2], "slot 2 is padding"),
        (4, [20], "slot 20 is padding or out of range"),
        (4, [4, 17], "page 4 \\(slots 16..19\\) is already free"),
    ],
)
def test_free_errors_change_nothing(p: int, bad: list[int], msg: str) -> None:
    a = TokenToKVPoolAllocator(16, p)
    a.alloc(12 if p == 4 else 8)  # p=1: slots 1..8 held, p=4: pages 1..3 held
    before = state(a)
    with pytest.raises(ValueError, match=msg):
        a.free(bad)
    assert state(a) == before


def test_double_free_after_free() -> None:
    a = TokenToKVPoolAllocator(8)
    x = a.alloc(4)
    a.free(x[:2])
    before = state(a)
    with pytest.raises(ValueError, match="slot 2 is already free"):
        a.free(x[1:3])
    assert state(a) == before


def test_returned_tensor_does_not_alias_free_list() -> None:
    a = TokenToKVPoolAllocator(8)
    x = a.alloc(4)
    a.free(x)
    a.free_group_begin()
    y = a.alloc(4)
    a.free(y)
    y.fill_(0)  # callers may reuse their tensors
    a.free_group_end()
    assert sorted(a.free_slots().tolist()) == list(range(1, 9))


# ---- random ops against the reference (page_size 1 wraps the ring) ----------


@pytest.mark.parametrize("p", [1, 2, 4])
def test_random_ops_match_reference_free_list(p: int) -> None:
    rng = random.Random(p)
    size = 32
    a, ref = TokenToKVPoolAllocator(size, p), RefFreeList(size, p)
    held: list[int] = []
    for _ in range(400):
        if rng.random() < 0.5:
            n = rng.randint(0, 12) // p * p
            got = a.alloc(n)
            exp = ref.alloc(n)
            assert (got is None) == (exp is None)
            if got is not None:
                assert got.tolist() == exp
                held += exp
        elif held:
            if p == 1:
                pick = rng.sample(held, rng.randint(1, len(held)))
            else:
                pages = sorted({s // p for s in held})
                chosen = rng.sample(pages, rng.randint(1, len(pages)))
                pick = [pg * p + rng.randrange(p) for pg in chosen for _ in range(2)]
            a.free(pick)
            ref.free(pick)
            gone = {s // p for s in pick}
            held = [s for s in held if s // p not in gone]
        assert a.free_slots().tolist() == ref.slots()
        assert a.available_size() + len(held) == size


# ---- free groups and clear --------------------------------------------------


@pytest.mark.parametrize("p", [1, 4])
def test_free_group_applies_at_end(p: int) -> None:
    a = TokenToKVPoolAllocator(16, p)
    x = a.alloc(12)
    rest = a.free_slots().tolist()
    assert len(rest) == 4
    a.free_group_begin()
    a.free(x[p : 2 * p])
    a.free(x[:p])
    assert a.available_size() == 4 and a.free_slots().tolist() == rest
    a.free_group_end()
    if p == 1:
        # One free of the group's slots in call order, at the back.
        assert a.free_slots().tolist() == rest + x[p : 2 * p].tolist() + x[:p].tolist()
    else:
        # One free of the group's unique pages, ascending, at the front.
        assert a.free_slots().tolist() == x[: 2 * p].tolist() + rest


def test_free_group_errors() -> None:
    a = TokenToKVPoolAllocator(8)
    x = a.alloc(4)
    a.free_group_begin()
    with pytest.raises(ValueError, match="slot 5 is already free"):
        a.free([5])
    a.free(x[:2])
    a.free(x[1:2])
    before = state(a)
    with pytest.raises(ValueError, match="slot 2 appears twice"):
        a.free_group_end()
    assert state(a) == before
    a.free_group_end()  # the failed group is closed
    a.free(x)
    assert a.available_size() == 8


@pytest.mark.parametrize("p", [1, 4])
def test_clear(p: int) -> None:
    a = TokenToKVPoolAllocator(16, p)
    a.alloc(8)
    a.free_group_begin()
    a.clear()
    assert state(a) == (16, list(range(p, 16 + p)))
    a.free(a.alloc(4))  # the group was dropped
    assert a.available_size() == 16


# ---- alloc_extend / alloc_decode --------------------------------------------


def _lens(lst: list[int], as_tensor: bool) -> torch.Tensor | list[int]:
    return torch.tensor(lst, dtype=torch.int64) if as_tensor else lst


@pytest.mark.parametrize("p", [2, 4, 16])
def test_alloc_extend_matches_reference(p: int) -> None:
    rng = random.Random(p)
    for trial in range(60):
        size = p * rng.randint(1, 24)
        a = TokenToKVPoolAllocator(size, p)
        held = a.alloc(size // 2 // p * p)
        # Two frees put pages in front out of ascending order: [later freed..., first freed..., never used...].
        q = held.numel() // p
        a.free(held[: q // 4 * p])
        a.free(held[q // 4 * p : q // 2 * p])
        prefix, seq, last = [], [], []
        for _ in range(rng.randint(1, 4)):
            q = rng.randint(0, 3 * p)
            prefix.append(q)
            seq.append(q + rng.randint(0, 3 * p))
            # last_loc: the slot after which this request's partial page continues.
            last.append(-1 if q == 0 else rng.randrange(1, size // p + 1) * p + (q - 1) % p)
        ext = sum(s - q for q, s in zip(prefix, seq))
        pages = [s // p for s in a.free_slots().tolist()[::p]]
        before = state(a)
        as_t = trial % 2 == 0
        got = a.alloc_extend(
            torch.tensor(prefix), _lens(prefix, as_t), torch.tensor(seq), _lens(seq, as_t), torch.tensor(last), ext
        )
        exp = ref_paged(pages, p, prefix, seq, last)
        if exp is None:
            assert got is None and state(a) == before
        else:
            assert got.dtype == torch.int64 and got.tolist() == exp
            assert [s // p for s in a.free_slots().tolist()[::p]] == pages


@pytest.mark.parametrize("p", [2, 4])
def test_alloc_decode_matches_reference(p: int) -> None:
    rng = random.Random(10 + p)
    for _ in range(60):
        size = p * rng.randint(1, 12)
        a = TokenToKVPoolAllocator(size, p)
        held = a.alloc(rng.randint(0, size // p) * p)
        a.free(held[: held.numel() // p // 2 * p])  # freed pages go in front
        seq = [rng.randint(1, 4 * p) for _ in range(rng.randint(1, 6))]
        last = [rng.randrange(1, size // p + 1) * p + (s - 2) % p if s > 1 else -1 for s in seq]
        pages = [s // p for s in a.free_slots().tolist()[::p]]
        before = state(a)
        got = a.alloc_decode(torch.tensor(seq), seq, torch.tensor(last))
        exp = ref_paged(pages, p, [s - 1 for s in seq], seq, last)
        if exp is None:
            assert got is None and state(a) == before
        else:
            assert got.tolist() == exp
            assert [s // p for s in a.free_slots().tolist()[::p]] == pages


def test_alloc_extend_known_case() -> None:
    a = TokenToKVPoolAllocator(32, 4)
    # req0: fresh 5 tokens; req1: prefix 3 ending at slot 10, 6 more tokens.
    got = a.alloc_extend(
        torch.tensor([0, 3]), [0, 3], torch.tensor([5, 9]), [5, 9], torch.tensor([-1, 10]), 11
    )
    assert got.tolist() == [4, 5, 6, 7, 8, 11, 12, 13, 14, 15, 16]
    assert a.free_slots()[:4].tolist() == [20, 21, 22, 23]


def test_alloc_extend_short_and_bad_args() -> None:
    a = TokenToKVPoolAllocator(8, 4)
    before = state(a)
    assert a.alloc_extend(torch.tensor([0]), [0], torch.tensor([9]), [9], torch.tensor([-1]), 9) is None
    assert state(a) == before
    with pytest.raises(ValueError, match="extend_num_tokens=4"):
        a.alloc_extend(torch.tensor([0]), [0], torch.tensor([5]), [5], torch.tensor([-1]), 4)
    with pytest.raises(ValueError, match="extend_num_tokens"):
        a.alloc_extend(torch.tensor([5]), [5], torch.tensor([4]), [4], torch.tensor([-1]), -1)
    assert state(a) == before


def test_alloc_decode_short_changes_nothing() -> None:
    a = TokenToKVPoolAllocator(8, 4)
    a.alloc(4)
    before = state(a)
    # Both requests start a page but only one page is free.
    assert a.alloc_decode(torch.tensor([5, 9]), [5, 9], torch.tensor([7, 7])) is None
    assert state(a) == before
    # Neither starts a page: no free page needed.
    assert a.alloc_decode(torch.tensor([6]), [6], torch.tensor([4])).tolist() == [5]


def test_page_size_one_extend_and_decode_are_plain_alloc() -> None:
    a = TokenToKVPoolAllocator(8)
    got = a.alloc_extend(torch.tensor([2, 0]), [2, 0], torch.tensor([4, 3]), [4, 3], torch.tensor([9, -1]), 5)
    assert got.tolist() == [1, 2, 3, 4, 5]
    assert a.alloc_decode(torch.tensor([5, 4]), torch.tensor([5, 4]), torch.tensor([2, 5])).tolist() == [6, 7]
    assert a.alloc_decode(torch.tensor([6, 5]), [6, 5], torch.tensor([6, 7])) is None
    assert a.available_size() == 1


# ---- SWA allocator ----------------------------------------------------------


def swa_state(a: SWATokenToKVPoolAllocator) -> tuple:
    return (
        a.full_available_size(),
        a.swa_available_size(),
        a.full_free_slots().tolist(),
        a.swa_free_slots().tolist(),
        a.full_to_swa_index_mapping.tolist(),
    )


def test_swa_construction() -> None:
    a = SWATokenToKVPoolAllocator(16, 8, page_size=4)
    assert (a.size_full, a.size_swa, a.size, a.page_size) == (16, 8, 8, 4)
    assert isinstance(a.full_attn_allocator, TokenToKVPoolAllocator)
    assert isinstance(a.swa_attn_allocator, TokenToKVPoolAllocator)
    assert a.full_to_swa_index_mapping.shape == (20,) and a.full_to_swa_index_mapping.dtype == torch.int64
    assert a.available_size() == 8
    assert a.translate_loc_from_full_to_swa(torch.tensor([-1, 0])).tolist() == [-1, 0]


def test_swa_alloc_maps_and_free_releases_both() -> None:
    a = SWATokenToKVPoolAllocator(8, 4)
    full = a.alloc(3)
    assert full.tolist() == [1, 2, 3]
    assert a.translate_loc_from_full_to_swa(full).tolist() == [1, 2, 3]
    assert (a.full_available_size(), a.swa_available_size(), a.available_size()) == (5, 1, 1)
    before = swa_state(a)
    assert a.alloc(2) is None  # window side short
    assert swa_state(a) == before
    a.free(full[1:])
    assert a.full_free_slots().tolist()[-2:] == [2, 3] and a.swa_free_slots().tolist() == [4, 2, 3]
    assert a.full_to_swa_index_mapping[:4].tolist() == [0, 1, 0, 0]


def test_swa_full_side_short() -> None:
    a = SWATokenToKVPoolAllocator(2, 8)
    before = swa_state(a)
    assert a.alloc(3) is None and swa_state(a) == before


def test_swa_free_swa_then_free_skips_tombstones() -> None:
    a = SWATokenToKVPoolAllocator(8, 8)
    full = a.alloc(4)
    a.free_swa(full[:2])
    assert a.swa_available_size() == 6 and a.full_available_size() == 4
    assert a.translate_loc_from_full_to_swa(full).tolist() == [0, 0, 3, 4]
    a.free_swa(full[:2])  # no window slot left: skipped
    assert a.swa_available_size() == 6
    a.free(full)  # full side of all four, window side of the two still mapped
    assert (a.full_available_size(), a.swa_available_size()) == (8, 8)
    before = swa_state(a)
    with pytest.raises(ValueError, match="slot 1 is already free"):
        a.free(full)
    assert swa_state(a) == before


def test_swa_free_full_only() -> None:
    a = SWATokenToKVPoolAllocator(8, 8)
    full = a.alloc(2)
    a.free_swa(full)
    a.free_full(full)
    assert (a.full_available_size(), a.swa_available_size()) == (8, 8)
    before = swa_state(a)
    with pytest.raises(ValueError, match="already free"):
        a.free_full(full)
    assert swa_state(a) == before


@pytest.mark.parametrize(
    "call,bad,msg",
    [
        ("free", [0], "slot 0 is padding"),
        ("free", [9], "out of range"),
        ("free", [1, 1], "appears twice"),
        ("free_full", [0], "padding"),
        ("free_swa", [9], "slot 9 is out of range"),
        ("free_swa", [-1], "slot -1 is out of range"),
        ("free_swa", [1, 1], "appears twice"),
    ],
)
def test_swa_errors_change_nothing(call: str, bad: list[int], msg: str) -> None:
    a = SWATokenToKVPoolAllocator(8, 8)
    a.alloc(4)
    before = swa_state(a)
    with pytest.raises(ValueError, match=msg):
        getattr(a, call)(bad)
    assert swa_state(a) == before


def test_swa_paged_free_swa_expands_pages() -> None:
    a = SWATokenToKVPoolAllocator(16, 16, page_size=4)
    full = a.alloc(8)
    a.free_swa(full[1:2])  # one slot frees its whole page's window slots
    assert a.translate_loc_from_full_to_swa(full).tolist() == [0, 0, 0, 0, 8, 9, 10, 11]
    assert a.swa_available_size() == 12 and a.full_available_size() == 8
    assert a.swa_free_slots().tolist() == [4, 5, 6, 7, 12, 13, 14, 15, 16, 17, 18, 19]  # page 1 in front
    a.free(full)
    assert (a.full_available_size(), a.swa_available_size()) == (16, 16)
    # Full side: pages 1, 2 in front; window side: page 2 (still mapped) in front of page 1.
    assert a.full_free_slots().tolist() == list(range(4, 20))
    assert a.swa_free_slots().tolist() == [8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15, 16, 17, 18, 19]


def test_swa_paged_extend_and_decode() -> None:
    p = 4
    a = SWATokenToKVPoolAllocator(32, 16, page_size=p)
    w = a.swa_attn_allocator.alloc(16)
    # Freed pages go in front, so two frees reorder the window free list to pages [3, 4, 1, 2].
    a.swa_attn_allocator.free(w[:8])
    a.swa_attn_allocator.free(w[8:])
    assert a.swa_free_slots().tolist() == list(range(12, 20)) + list(range(4, 12))
    got = a.alloc_extend(torch.tensor([0, 0]), [0, 0], torch.tensor([5, 3]), [5, 3], torch.tensor([-1, -1]), 8)
    assert got.tolist() == [4, 5, 6, 7, 8, 12, 13, 14]
    swa = a.translate_loc_from_full_to_swa(got).tolist()
    assert swa == [12, 13, 14, 15, 16, 4, 5, 6]
    # Decode: req0 continues its partial page (seq 6), req1 fills its page end (seq 4).
    dec = a.alloc_decode(torch.tensor([6, 4]), [6, 4], torch.tensor([8, 14]))
    assert dec.tolist() == [9, 15]
    assert a.translate_loc_from_full_to_swa(dec).tolist() == [17, 7]
    # Window side has one page left; two new pages are needed.
    before = swa_state(a)
    assert a.alloc_decode(torch.tensor([9, 5]), [9, 5], torch.tensor([11, 15])) is None
    assert a.alloc_extend(torch.tensor([0]), [0], torch.tensor([8]), [8], torch.tensor([-1]), 8) is None
    assert swa_state(a) == before


def test_swa_page_size_one_extend_decode() -> None:
    a = SWATokenToKVPoolAllocator(8, 4)
    got = a.alloc_extend(torch.tensor([0]), [0], torch.tensor([3]), [3], torch.tensor([-1]), 3)
    assert got.tolist() == [1, 2, 3]
    assert a.alloc_decode(torch.tensor([4]), [4], torch.tensor([3])).tolist() == [4]
    assert a.alloc_decode(torch.tensor([5]), [5], torch.tensor([4])) is None
    assert a.translate_loc_from_full_to_swa(torch.arange(1, 5)).tolist() == [1, 2, 3, 4]


def test_swa_alloc_bad_size() -> None:
    a = SWATokenToKVPoolAllocator(16, 8, page_size=4)
    before = swa_state(a)
    with pytest.raises(ValueError, match="multiple"):
        a.alloc(3)
    with pytest.raises(ValueError):
        a.alloc(-4)
    assert swa_state(a) == before


def test_swa_free_group() -> None:
    a = SWATokenToKVPoolAllocator(8, 8)
    full = a.alloc(6)
    a.free_group_begin()
    a.free(full[:2])
    a.free_swa(full[2:4])
    a.free_full(full[4:5])  # caller released its window side... not yet: mapping stays
    assert (a.full_available_size(), a.swa_available_size()) == (2, 2)
    # free_swa resolves its window slots at call time
    assert a.translate_loc_from_full_to_swa(full[2:4]).tolist() == [0, 0]
    with pytest.raises(ValueError, match="already free"):
        a.free([8])
    a.free_group_end()
    assert a.full_free_slots().tolist() == [7, 8, 1, 2, 5]
    assert a.swa_free_slots().tolist() == [7, 8, 1, 2, 3, 4]


def test_swa_clear() -> None:
    a = SWATokenToKVPoolAllocator(8, 4, page_size=2)
    a.alloc(4)
    a.clear()
    assert a.full_to_swa_index_mapping.abs().sum().item() == 0
    assert a.translate_loc_from_full_to_swa([-1]).tolist() == [-1]
    assert (a.full_available_size(), a.swa_available_size()) == (8, 4)


# ---- KV buffers ---------------------------------------------------------------


def test_mha_pool() -> None:
    pool = MHATokenToKVPool(8, page_size=2, dtype=torch.float16, head_num=2, head_dim=4, layer_num=3, device="cpu")
    assert len(pool.k_buffer) == len(pool.v_buffer) == 3
    assert pool.get_key_buffer(1).shape == (10, 2, 4) and pool.get_value_buffer(1).dtype == torch.float16
    loc = torch.tensor([2, 5])
    k, v = torch.randn(2, 2, 4), torch.randn(2, 2, 4)
    pool.set_kv_buffer(1, loc, k, v)
    assert torch.equal(pool.get_key_buffer(1)[loc], k.half())
    assert torch.equal(pool.get_value_buffer(1)[loc], v.half())
    assert pool.get_key_buffer(0).abs().sum() == 0
    assert pool.mem_usage_bytes() == 2 * 3 * 10 * 2 * 4 * 2
    with pytest.raises(ValueError):
        MHATokenToKVPool(0, 1, torch.float16, 1, 1, 1, "cpu")


# ---- devices ------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("p", [1, 4])
def test_cuda_tensors_stay_on_device(p: int) -> None:
    a = TokenToKVPoolAllocator(64, p, device="cuda")
    x = a.alloc(8)
    assert x.is_cuda and a.free_slots().is_cuda
    a.free(x.cpu())
    assert a.available_size() == 64
    s = SWATokenToKVPoolAllocator(64, 32, p, device="cuda")
    y = s.alloc(8)
    assert y.is_cuda and s.translate_loc_from_full_to_swa(y).is_cuda
    if p > 1:
        e = a.alloc_extend(
            torch.tensor([0], device="cuda"), [0], torch.tensor([6], device="cuda"), [6],
            torch.tensor([-1], device="cuda"), 6,
        )
        assert e.is_cuda and e.numel() == 6
        d = a.alloc_decode(torch.tensor([7], device="cuda"), [7], e[-1:])
        assert d.tolist() == [e[-1].item() + 1]
    pool = ReqToTokenPool(2, 4, device="cuda")
    assert pool.req_to_token.is_cuda

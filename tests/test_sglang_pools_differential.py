"""Differential checks of kvcore's pools: random sequences through SGLang's own pools and ours.

The request-row pool, the token and paged allocators (``alloc`` / ``alloc_extend`` /
``alloc_decode`` / ``free`` / ``free_segment``) and the SWA allocator: every answer,
available size and the free lists themselves must agree after every operation.  The
caches on these pools are checked in the plugins' own differential tests
(``plugins/*/tests/test_sglang_*``).  Needs SGLang 0.5.19's source
(``$KVCORE_SGLANG_SRC`` or ``/tmp/sgl/src``); skipped otherwise.
"""

from __future__ import annotations

import random
import types

import pytest
import torch

from kvcore.pools import ReqToTokenPool, TokenToKVPoolAllocator
from kvcore.pools.swa_allocator import SWATokenToKVPoolAllocator
from kvcore.record import ReqKvInfo
from tools.differential import our_free_pages, sglang_free_pages
from tools.sglang_loader import default_src, load_sglang

SRC = default_src()
pytestmark = pytest.mark.skipif(SRC is None, reason="SGLang source not found (set KVCORE_SGLANG_SRC)")


@pytest.fixture(scope="module")
def sg():
    return load_sglang(SRC)


def test_req_to_token_pool_rows(sg):
    for seed in range(10):
        rng = random.Random(seed)
        s = sg.ReqToTokenPool(size=7, max_context_len=4, device="cpu", enable_memory_saver=False)
        o = ReqToTokenPool(7, 4)
        held = []
        for _ in range(60):
            if rng.random() < 0.55:
                reqs = [(types.SimpleNamespace(kv=sg.ReqKvInfo()), types.SimpleNamespace(kv=ReqKvInfo()))
                        for _ in range(rng.randrange(1, 4))]
                rs = s.alloc([a for a, _ in reqs])
                ro = o.alloc([b for _, b in reqs])
                assert rs == ro
                if rs is not None:
                    held.extend(reqs)
            elif held:
                a, b = held.pop(rng.randrange(len(held)))
                s.free(a)
                o.free(b)
            assert s.available_size() == o.available_size()
            assert s.free_slots == o.free_rows()


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_token_allocator(sg, page_size):
    ps = page_size
    for seed in range(8):
        rng = random.Random(seed * 31 + ps)
        size = 40 * ps
        s = sg.make_allocator(size, ps)
        o = TokenToKVPoolAllocator(size, ps)
        held: list[list[torch.Tensor]] = []  # per "request": [sglang slots, our slots] of its row
        for step in range(150):
            op = rng.random()
            if op < 0.3:
                n = rng.randrange(0, 8) * ps
                a, b = s.alloc(n), o.alloc(n)
                assert (a is None) == (b is None)
                if a is not None:
                    assert a.tolist() == b.tolist()
                    if n:
                        held.append([a, b])
            elif op < 0.55 and ps > 1:
                # alloc_extend over a batch: some requests continue a held row, some are new.
                bs = rng.randrange(1, 4)
                pre, seq, ls, lo, owners = [], [], [], [], []
                for _ in range(bs):
                    if held and rng.random() < 0.5:
                        h = held[rng.randrange(len(held))]
                        if any(h is x for x in owners):
                            h = None
                    else:
                        h = None
                    p0 = len(h[0]) if h is not None else 0
                    pre.append(p0)
                    seq.append(p0 + rng.randrange(1, 3 * ps))
                    ls.append(int(h[0][-1]) if h is not None else -1)
                    lo.append(int(h[1][-1]) if h is not None else -1)
                    owners.append(h)
                T = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
                n = sum(seq) - sum(pre)
                a = s.alloc_extend(T(pre), T(pre), T(seq), T(seq), T(ls), n)
                b = o.alloc_extend(T(pre), T(pre), T(seq), T(seq), T(lo), n)
                assert (a is None) == (b is None)
                if a is not None:
                    assert a.tolist() == b.tolist(), (pre, seq, ls)
                    off = 0
                    for h, p0, s1 in zip(owners, pre, seq):
                        k = s1 - p0
                        if h is None:
                            held.append([a[off:off + k], b[off:off + k]])
                        else:
                            h[0] = torch.cat([h[0], a[off:off + k]])
                            h[1] = torch.cat([h[1], b[off:off + k]])
                        off += k
            elif op < 0.7 and ps > 1 and held:
                hs = rng.sample(held, min(len(held), rng.randrange(1, 4)))
                T = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
                seq = [len(h[0]) + 1 for h in hs]
                a = s.alloc_decode(T(seq), T(seq), T([int(h[0][-1]) for h in hs]))
                b = o.alloc_decode(T(seq), T(seq), T([int(h[1][-1]) for h in hs]))
                assert (a is None) == (b is None)
                if a is not None:
                    assert a.tolist() == b.tolist()
                    for i, h in enumerate(hs):
                        h[0] = torch.cat([h[0], a[i:i + 1]])
                        h[1] = torch.cat([h[1], b[i:i + 1]])
            elif held:
                h = held.pop(rng.randrange(len(held)))
                # whole pages are owned by one row; free in a random order, as a batch does
                perm = torch.randperm(len(h[0]), generator=torch.Generator().manual_seed(step))
                if rng.random() < 0.5:
                    s.free_segment(h[0], start_pos=0)
                    o.free_segment(h[1], start_pos=0)
                else:
                    s.free(h[0][perm])
                    o.free(h[1][perm])
            assert s.available_size() == o.available_size(), (seed, step)
            assert sglang_free_pages(s) == our_free_pages(o), (seed, step)


@pytest.mark.parametrize("page_size", [1, 4])
def test_swa_allocator(sg, page_size):
    ps = page_size
    for seed in range(8):
        rng = random.Random(seed * 7 + ps)
        s = sg.SWATokenToKVPoolAllocator(32 * ps, 16 * ps, ps, torch.float16, "cpu", sg.make_swa_kvpool(), False)
        o = SWATokenToKVPoolAllocator(32 * ps, 16 * ps, ps)
        held = []
        for step in range(120):
            op = rng.random()
            if op < 0.4:
                n = rng.randrange(1, 5) * ps
                if ps == 1:
                    a, b = s.alloc(n), o.alloc(n)
                else:
                    T = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
                    a = s.alloc_extend(T([0]), T([0]), T([n]), T([n]), T([-1]), n)
                    b = o.alloc_extend(T([0]), T([0]), T([n]), T([n]), T([-1]), n)
                assert (a is None) == (b is None)
                if a is not None:
                    assert a.tolist() == b.tolist()
                    held.append([a, b, True])
            elif op < 0.6 and held:
                h = rng.choice(held)
                if h[2]:
                    s.free_swa(h[0])
                    o.free_swa(h[1])
                    h[2] = False
            elif op < 0.75 and held:
                h = held.pop(rng.randrange(len(held)))
                if h[2]:
                    s.free(h[0])
                    o.free(h[1])
                else:
                    s.free_full(h[0])
                    o.free_full(h[1])
            elif held:
                h = held.pop(rng.randrange(len(held)))
                s.free(h[0])  # SGLang's free after free_swa: the cleared mapping skips the window side
                o.free(h[1])
            assert s.full_available_size() == o.full_available_size(), (seed, step)
            assert s.swa_available_size() == o.swa_available_size(), (seed, step)
            assert s.full_to_swa_index_mapping[:-1].tolist() == o.full_to_swa_index_mapping.tolist()
            assert int(s.full_to_swa_index_mapping[-1]) == -1  # SGLang's padding entry
            assert sglang_free_pages(s.full_attn_allocator) == our_free_pages(o.full_attn_allocator)
            assert sglang_free_pages(s.swa_attn_allocator) == our_free_pages(o.swa_attn_allocator)

"""kvcore's DecodeReqToTokenPool against SGLang's own class (``srt/disaggregation/decode.py``).

Random alloc / free sequences, both pools fed the same records: the rows handed
out, the free list and the refusals must agree.  Needs SGLang 0.5.19's source
(``$KVCORE_SGLANG_SRC``); skipped otherwise.  ``size`` is the running rows in
both (kvcore's ``num_rows`` counts every row).  Documented difference:
kvcore refuses a double free or a foreign row with ValueError where SGLang
corrupts its free list.
"""

from __future__ import annotations

import random

import pytest

from kvcore import DecodeReqToTokenPool, InvariantChecker, ReqKvInfo
from tools.sglang_loader import default_src

SRC = default_src()
pytestmark = pytest.mark.skipif(SRC is None, reason="SGLang source not found (set KVCORE_SGLANG_SRC)")


class _SgKv:
    """The fields SGLang's pool reads of a record."""

    def __init__(self) -> None:
        self.req_pool_idx = None
        self.kv_allocated_len = 0

    @property
    def holds_kv(self) -> bool:
        return self.req_pool_idx is not None


class _Owner:
    def __init__(self, rid: str, kv) -> None:
        self.rid = rid
        self.kv = kv


@pytest.fixture(scope="module")
def sg_pool_cls():
    from tools.sglang_decode_shim import load_decode_req_to_token_pool

    return load_decode_req_to_token_pool(SRC)


def _pair(cls, size: int, pre: int, width: int = 8):
    theirs = cls(size=size, max_context_len=width, device="cpu", enable_memory_saver=False, pre_alloc_size=pre)
    ours = DecodeReqToTokenPool(size, width, pre_alloc_size=pre)
    return ours, theirs


def test_shape_and_first_rows(sg_pool_cls):
    ours, theirs = _pair(sg_pool_cls, 3, 2)
    assert tuple(ours.req_to_token.shape) == tuple(theirs.req_to_token.shape) == (6, 8)
    assert ours.size == theirs.size == 3 and ours.pre_alloc_size == theirs.pre_alloc_size == 2
    assert ours.free_rows() == theirs.free_slots and ours.available_size() == theirs.available_size()


@pytest.mark.parametrize("seed", range(6))
def test_random_alloc_free_sequences_agree(sg_pool_cls, seed):
    rng = random.Random(seed)
    size, pre = rng.randint(1, 4), rng.randint(0, 4)
    ours, theirs = _pair(sg_pool_cls, size, pre)
    n = 8
    mine = [_Owner(f"r{i}", ReqKvInfo()) for i in range(n)]
    sgs = [_Owner(f"r{i}", _SgKv()) for i in range(n)]
    for _ in range(200):
        if rng.random() < 0.55:
            picks = rng.sample(range(n), rng.randint(1, 3))
            # Only records without a row, or holding one with allocated KV (both pools refuse the rest).
            picks = [i for i in picks if mine[i].kv.req_pool_idx is None or mine[i].kv.kv_allocated_len > 0]
            got = ours.alloc([mine[i] for i in picks])
            want = theirs.alloc([sgs[i] for i in picks])
            assert got == want
            if got is not None:
                for i in picks:
                    mine[i].kv.kv_allocated_len = sgs[i].kv.kv_allocated_len = 1
        else:
            held = [i for i in range(n) if mine[i].kv.req_pool_idx is not None]
            if not held:
                continue
            i = rng.choice(held)
            ours.free(mine[i])
            theirs.free(sgs[i])
            mine[i].kv.kv_allocated_len = sgs[i].kv.kv_allocated_len = 0
        assert ours.free_rows() == theirs.free_slots
        assert [o.kv.req_pool_idx for o in mine] == [o.kv.req_pool_idx for o in sgs]


def test_reused_row_without_allocated_kv_is_refused_by_both(sg_pool_cls):
    ours, theirs = _pair(sg_pool_cls, 2, 1)
    a, sa = _Owner("a", ReqKvInfo()), _Owner("a", _SgKv())
    assert ours.alloc([a]) == theirs.alloc([sa]) == [1]
    with pytest.raises(ValueError, match="allocated KV"):
        ours.alloc([a])
    with pytest.raises(AssertionError, match="allocated KV"):
        theirs.alloc([sa])
    assert ours.free_rows() == theirs.free_slots


def test_engine_on_a_decode_pool_checks_clean():
    import kvcore
    from kvcore.engine import Engine

    cache = kvcore.create_cache("chunk", size=64, max_num_reqs=2, pre_alloc_size=2, max_context_len=32)
    eng = Engine(cache)
    reqs = [kvcore.Req(f"r{i}", list(range(5)), [9]) for i in range(4)]
    for r in reqs:
        assert eng.pre_alloc(r) is not None
    assert [r.kv.req_pool_idx for r in reqs] == [1, 2, 3, 4]
    InvariantChecker(cache).check(reqs)
    for r in reqs:
        eng.process_prebuilt(r)
        eng.finish(r)
    InvariantChecker(cache).check([])

import pytest
import torch

from kvcore import RadixKey, Req, ReqKvInfo
from kvcore.keys import as_radix_key


@pytest.mark.parametrize(
    "protected, floor, page, expected",
    [(16, 20, 16, 32), (16, 10, 16, 16), (0, 5, 4, 8), (0, 5, 1, 5), (32, 32, 16, 32), (0, 0, 16, 0)],
)
def test_swa_dead_lo(protected, floor, page, expected):
    kv = ReqKvInfo(cache_protected_len=protected, swa_evict_floor=floor)
    assert kv.swa_dead_lo(page) == expected


def test_record_is_slotted_kw_only_and_defaulted():
    kv = ReqKvInfo()
    assert kv.req_pool_idx is None and not kv.is_held and kv.is_released
    with pytest.raises(TypeError):
        ReqKvInfo(3)  # kw_only
    with pytest.raises(AttributeError):
        kv.not_a_field = 1  # slots


def test_mark_released_zeroes_only_allocated_and_cursor():
    kv = ReqKvInfo(req_pool_idx=3, cache_protected_len=16, kv_committed_len=40, kv_allocated_len=48,
                   swa_evict_floor=8, swa_evicted_seqlen=32)
    kv.mark_released()
    assert (kv.kv_allocated_len, kv.swa_evicted_seqlen) == (0, 0)
    assert (kv.req_pool_idx, kv.cache_protected_len, kv.kv_committed_len, kv.swa_evict_floor) == (3, 16, 40, 8)
    assert kv.is_held and kv.is_released


def test_is_released_needs_both_zero():
    assert not ReqKvInfo(kv_allocated_len=1).is_released
    assert not ReqKvInfo(swa_evicted_seqlen=1).is_released


def test_req_fill_ids_and_detach():
    req = Req("r", [1, 2, 3], output_ids=[4])
    assert req.fill_ids == [1, 2, 3, 4] and req.seqlen == 4
    req.kv.req_pool_idx = 5
    kv = req.detach_kv()
    assert kv.req_pool_idx == 5
    assert req.kv is not kv and req.kv.req_pool_idx is None
    with pytest.raises(TypeError):
        Req("bad", [1], kv=None)


def test_components_move_with_the_record():
    req = Req("r", [1])
    req.kv.components["mamba"] = {"slot": 7}
    kv = req.detach_kv()
    assert kv.components == {"mamba": {"slot": 7}} and req.kv.components == {}


def test_keys_validate():
    assert as_radix_key([1, 2]).token_ids == [1, 2]
    assert as_radix_key(torch.tensor([3, 4])).token_ids == [3, 4]
    k = RadixKey([1, 2, 3], extra_key="lora")
    assert k[:2] == RadixKey([1, 2], "lora") and len(k) == 3
    assert as_radix_key(k) is k
    with pytest.raises(TypeError, match="RadixKey"):
        as_radix_key("abc")
    with pytest.raises(TypeError, match="ints"):
        as_radix_key([1.5, 2])
    with pytest.raises(TypeError, match="ints"):
        as_radix_key([1, "x"])
    with pytest.raises(ValueError, match="non-negative"):
        as_radix_key([1, -2])
    with pytest.raises(TypeError, match="1-D"):
        as_radix_key(torch.ones(2, 2, dtype=torch.int64))


def test_fill_ids_is_the_prompt_until_a_token_is_generated_and_fill_slice_agrees():
    # A chunked prefill reads len(req.fill_ids) once per chunk: no copy of a long prompt then.
    req = Req("r", [5, 6, 7, 8])
    assert req.fill_ids is req.origin_input_ids
    req.output_ids += [9, 10]
    assert req.fill_ids == [5, 6, 7, 8, 9, 10] and req.origin_input_ids == [5, 6, 7, 8]
    for start in range(7):
        for end in range(start, 7):
            assert req.fill_slice(start, end) == req.fill_ids[start:end]
    req.output_ids.clear()
    assert req.fill_ids is req.origin_input_ids

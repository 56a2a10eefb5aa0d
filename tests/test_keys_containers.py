"""Key containers: lists, array, numpy arrays and tensors are taken as they are (converted in C)."""

from array import array

import numpy as np
import pytest
import torch

import kvcore
from kvcore import RadixKey
from kvcore.keys import CheckedIds, as_radix_key, check_token_ids, checked_key, token_id_list
from kvcore.record import Req
from kvcore.testing import admit, check_invariants, finish, make_req, prefill

IDS = [5, 70000, 3, 2**40, 9]

CONTAINERS = {
    "list": list,
    "tuple": tuple,
    "array_q": lambda ids: array("q", ids),
    "array_Q": lambda ids: array("Q", ids),
    "numpy_int64": lambda ids: np.array(ids, dtype=np.int64),
    "numpy_uint64": lambda ids: np.array(ids, dtype=np.uint64),
    "tensor_int64": lambda ids: torch.tensor(ids, dtype=torch.int64),
}


def build(**opts):
    opts.setdefault("size", 256)
    opts.setdefault("max_num_reqs", 4)
    opts.setdefault("max_context_len", 128)
    return kvcore.create_cache("radix", **opts)


@pytest.mark.parametrize("name", sorted(CONTAINERS))
def test_radix_key_from_any_container(name):
    key = RadixKey(CONTAINERS[name](IDS), "ns")
    assert type(key.token_ids) is list and key.token_ids == IDS
    assert all(type(t) is int for t in key.token_ids)
    assert key.extra_key == "ns"
    assert as_radix_key(CONTAINERS[name](IDS)).token_ids == IDS


def test_list_kept_as_is_and_checked_later():
    ids = [1, 2, 3]
    key = RadixKey(ids)
    assert key.token_ids is ids and not key.validated
    assert checked_key(key) is key and key.validated


def test_typed_containers_are_known_valid_without_a_scan():
    for make in (lambda: array("q", IDS), lambda: array("H", [1, 2]), lambda: np.array(IDS),
                 lambda: torch.tensor(IDS), lambda: torch.tensor([1, 2], dtype=torch.uint8)):
        assert RadixKey(make()).validated


@pytest.mark.parametrize("bad", [
    array("q", [3, -1, 4]), array("b", [1, -2]), np.array([3, -1]), torch.tensor([3, -1], dtype=torch.int32),
])
def test_negative_ids_in_typed_containers_refused(bad):
    key = RadixKey(bad)
    assert not key.validated
    with pytest.raises(ValueError, match="non-negative, got -"):
        checked_key(key)


@pytest.mark.parametrize("typecode, bad", [("q", -1), ("Q", 2**63)])
@pytest.mark.parametrize("where", [0, 2047, 4095])
def test_long_eight_byte_arrays_sign_tested_in_place(typecode, bad, where):
    """SGLang's array("q") prompts: a long one is sign-tested by one argmin in place, same answers."""
    ids = list(range(2, 4098))
    assert RadixKey(array(typecode, ids)).validated
    ids[where] = bad
    key = RadixKey(array(typecode, ids))
    assert not key.validated
    with pytest.raises(ValueError, match="non-negative|does not fit"):
        checked_key(key)


def test_checked_ids_are_not_scanned_again_and_slice_to_plain_lists():
    ids = CheckedIds(array("q", [5, 0, 7]).tolist())
    assert ids == [5, 0, 7] and isinstance(ids, list)
    assert check_token_ids(ids) is False  # valid by construction; whether it holds a 0 or 1 is not scanned for
    assert type(ids[1:]) is list  # what a tree keeps of it is a plain list
    with pytest.raises(ValueError, match="non-negative"):
        check_token_ids(ids[:1] + [-1])


@pytest.mark.parametrize("bad, what", [
    (array("d", [1.0]), "typecode 'd'"),
    (np.array([1.5]), "1-D integer array"),
    (np.array([[1, 2]]), "1-D integer array"),
    (np.array([True, False]), "1-D integer array"),
    (torch.tensor([1.0]), "1-D integer tensor"),
    (torch.tensor([True]), "1-D integer tensor"),
    (torch.tensor([[1, 2]]), "1-D integer tensor"),
    ("abc", "a key must be"),
    (3.5, "a key must be"),
])
def test_bad_containers_refused(bad, what):
    with pytest.raises(TypeError, match=what):
        RadixKey(bad)
    with pytest.raises(TypeError, match=what):
        checked_key(bad)


def test_token_id_list_reports_validity():
    assert token_id_list([1, 2]) == ([1, 2], False)
    assert token_id_list(array("Q", [1, 2])) == ([1, 2], True)
    assert token_id_list(range(3)) == ([0, 1, 2], False)


def test_check_token_ids_long_keys_and_bools():
    long = list(range(2, 1002))
    assert check_token_ids(long) is True  # no 0 or 1: no bool possible
    assert check_token_ids([0] + long) is False
    with pytest.raises(TypeError, match="got bool"):
        check_token_ids(long + [True])
    with pytest.raises(TypeError, match="got bool"):
        check_token_ids([False, 5])
    assert check_token_ids(long + [1], refuse_bools=False) is False


def test_indexing_gives_keys_as_in_sglang():
    key = RadixKey([10, 20, 30], "ns")
    one = key[0]
    assert isinstance(one, RadixKey) and one.token_ids == [10] and one.extra_key == "ns"
    assert key[-1].token_ids == [30]
    assert key[1:].token_ids == [20, 30] and key[1:].extra_key == "ns"
    assert list(key) == [10, 20, 30] and key.token_ids[0] == 10
    with pytest.raises(IndexError):
        key[3]
    with pytest.raises(ValueError, match="step"):
        key[::2]


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("name", sorted(CONTAINERS))
def test_match_and_insert_take_any_container(name, page_size):
    cache = build(page_size=page_size)
    alloc = cache.token_to_kv_pool_allocator
    make = CONTAINERS[name]
    ids = list(range(100, 116))
    slots = alloc.alloc(16)
    assert cache.match_prefix(make(ids)).prefix_len == 0
    assert cache.insert(make(ids), slots).prefix_len == 0
    assert cache.match_prefix(make(ids[:8] + [7] * 8)).prefix_len == 8
    assert cache.match_prefix(make(ids)).device_indices.tolist() == slots.tolist()
    nodes = [n for n in kvcore.tree.iter_subtree(cache.root_node)]
    assert all(type(t) is int for n in nodes for t in n.key)
    check_invariants(cache)


def test_fresh_equal_key_after_match_reuses_the_walk():
    cache = build()
    alloc = cache.token_to_kv_pool_allocator
    ids = list(range(40, 56))
    first = alloc.alloc(16)
    cache.insert(RadixKey(ids[:8]), first[:8])
    alloc.free(first[8:])
    cache.match_prefix(RadixKey(ids[:]))
    slots = alloc.alloc(8)
    res = cache.insert(RadixKey(ids[:]), torch.cat([first[:8], slots]))
    assert res.prefix_len == 8
    assert cache.match_prefix(ids).device_indices.tolist() == first[:8].tolist() + slots.tolist()
    check_invariants(cache)


def test_fresh_key_with_bool_after_match_still_refused():
    cache = build()
    alloc = cache.token_to_kv_pool_allocator
    ids = [7, 8, 1, 9]  # the unmatched rest holds a 1: an equal key may hold True there
    cache.match_prefix(RadixKey(ids))
    slots = alloc.alloc(4)
    with pytest.raises(TypeError, match="got bool"):
        cache.insert(RadixKey([7, 8, True, 9]), slots)
    assert cache.total_size() == 0
    assert cache.insert(RadixKey([7, 8, 1, 9]), slots).prefix_len == 0
    check_invariants(cache)


def test_equal_non_int_key_after_match_stores_the_checked_ids():
    """A token equal to one just checked is taken as that id (as on the walked path): the tree keeps ints."""
    cache = build()
    alloc = cache.token_to_kv_pool_allocator
    cache.match_prefix(RadixKey([7, 8, 9, 10]))
    cache.insert(RadixKey([7.0, 8, 9, 10]), alloc.alloc(4))
    (node,) = kvcore.tree.iter_subtree(cache.root_node)
    assert node.key == [7, 8, 9, 10] and all(type(t) is int for t in node.key)
    # Without that match the same key is checked and refused.
    other = build()
    held = other.token_to_kv_pool_allocator.alloc(4)
    with pytest.raises(TypeError, match="got float"):
        other.insert(RadixKey([7.0, 8, 9, 10]), held)
    other.token_to_kv_pool_allocator.free(held)
    check_invariants(cache)
    check_invariants(other)


class ContainerReq(Req):
    """A request whose ``fill_ids`` come in another container (as an engine may hold them)."""

    __slots__ = ("convert",)

    @property
    def fill_ids(self):
        return self.convert(self.origin_input_ids + self.output_ids)


@pytest.mark.parametrize("name", ["array_q", "numpy_int64", "tensor_int64"])
def test_cache_finished_and_unfinished_req_with_container_fill_ids(name):
    cache = build(page_size=2)
    prompt = list(range(300, 320))

    def make(rid):
        base = make_req(rid, prompt)
        req = ContainerReq(base.rid, base.origin_input_ids)
        req.convert = CONTAINERS[name]
        return req

    a, b = make("a"), make("b")
    assert admit(cache, a) and prefill(cache, a, 10)  # cache_unfinished_req
    assert admit(cache, b) and prefill(cache, b, 10)
    assert b.kv.cache_protected_len == 10
    check_invariants(cache, [a, b])
    prefill(cache, a)
    prefill(cache, b)
    finish(cache, a)
    finish(cache, b)  # cache_finished_req
    assert cache.match_prefix(CONTAINERS[name](prompt)).prefix_len == 20
    check_invariants(cache)

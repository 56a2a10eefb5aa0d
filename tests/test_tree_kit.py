"""Unit tests of the public tree kit, ``kvcore.tree``."""

from __future__ import annotations

import random

import pytest
import torch

import kvcore.tree as kt
from kvcore import RadixKey
from kvcore.tree import (
    KVEventLog,
    LRUList,
    Node,
    alloc_value,
    check_locked,
    check_token_ids,
    checked_key,
    checked_value,
    child_key,
    descend,
    edge_match_len,
    iter_subtree,
    join_values,
    lock_path,
    path_to_root,
    path_values,
    prefix_match_len,
    request_ids,
    split_node,
    tree_lines,
    unlock_path,
)
from kvcore.tree.events import (
    AllPagesCleared,
    PageRemoved,
    PageStored,
    chain_page_hashes,
    page_hash,
    record_removed,
    record_stored,
)


def reference_len(ids, pos, key, n, page_size):
    m = 0
    limit = min(n, len(key), len(ids) - pos)
    while m < limit and ids[pos + m] == key[m]:
        m += 1
    return m - m % page_size


# ---------------------------------------------------------------- prefix_match_len


@pytest.mark.parametrize("page_size", [1, 16])
def test_prefix_match_len_edges(page_size):
    key = list(range(100, 164))
    assert prefix_match_len(key, 0, key, 64, page_size) == 64
    assert prefix_match_len(key, 0, key, 0, page_size) == 0
    assert prefix_match_len([], 0, key, 64, page_size) == 0
    # n shorter than the key: at most n (floored to pages).
    assert prefix_match_len(key, 0, key, 40, page_size) == 40 - 40 % page_size
    # ids shorter than the key, n larger than both: never more than what exists.
    assert prefix_match_len(key[:33], 0, key, 64, page_size) == 33 - 33 % page_size
    assert prefix_match_len(key, 0, key[:20], 64, page_size) == 20 - 20 % page_size
    # An offset into ids.
    ids = [7] * 5 + key
    assert prefix_match_len(ids, 5, key, 64, page_size) == 64
    # A mismatch at every position.
    for at in range(64):
        other = list(key)
        other[at] = -1
        assert prefix_match_len(other, 0, key, 64, page_size) == at - at % page_size, at
    # First token differs.
    assert prefix_match_len([0] + key[1:], 0, key, 64, page_size) == 0


@pytest.mark.parametrize("page_size", [1, 16])
def test_prefix_match_len_random_against_reference(page_size):
    rng = random.Random(page_size)
    for _ in range(500):
        n_key = rng.randrange(0, 300)
        key = [rng.randrange(4) for _ in range(n_key)]
        common = rng.randrange(0, n_key + 1)
        pos = rng.randrange(0, 5)
        ids = [9] * pos + key[:common] + [rng.randrange(4) for _ in range(rng.randrange(0, 300))]
        n = rng.randrange(0, 320)
        assert prefix_match_len(ids, pos, key, n, page_size) == reference_len(ids, pos, key, n, page_size)


def test_child_key_pages_and_namespace():
    ids = [5, 6, 7, 8, 9]
    assert child_key(ids) == 5
    assert child_key(ids, 2) == 7
    assert child_key(ids, 0, 2) == (5, 6)
    assert child_key(ids, 2, 2) == (7, 8)
    assert child_key(ids, 0, 1, "lora") == ("lora", 5)
    assert child_key(ids, 0, 2, "lora") == ("lora", (5, 6))
    assert child_key(ids, 0, 2, "a") != child_key(ids, 0, 2, "b") != child_key(ids, 0, 2)


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "ids, exc, msg",
    [
        ([1, 2.5], TypeError, r"token ids must be ints, got float \(2.5\)"),
        ([1, "a"], TypeError, r"token ids must be ints, got str \('a'\)"),
        ([1, None], TypeError, "token ids must be ints, got NoneType"),
        ([3, -1], ValueError, "token ids must be non-negative, got -1"),
        ([1 << 64], ValueError, f"token id {1 << 64} does not fit in a signed 64-bit int"),
        ([1 << 63], ValueError, f"token id {1 << 63} does not fit in a signed 64-bit int"),
    ],
)
def test_check_token_ids_errors(ids, exc, msg):
    with pytest.raises(exc, match=msg):
        check_token_ids(ids)
    with pytest.raises(exc, match=msg):
        checked_key(ids)
    with pytest.raises(exc, match=msg):
        checked_key(RadixKey(ids, "ns"))


def test_check_token_ids_start_and_valid_keys():
    check_token_ids([])
    check_token_ids([0, 1, (1 << 63) - 1])
    check_token_ids([-1, 2, 3], 1)  # only ids[1:] are checked
    check_token_ids([-1], 5)
    with pytest.raises(ValueError):
        check_token_ids([1, 2, -3], 1)


def test_checked_key_accepts_key_likes_and_remembers():
    rk = checked_key(torch.tensor([1, 2, 3]))
    assert rk.token_ids == [1, 2, 3] and rk.validated and rk.extra_key is None
    assert checked_key((4, 5)).token_ids == [4, 5]
    key = RadixKey([1, 2], "ns")
    assert checked_key(key) is key and key.validated
    with pytest.raises(TypeError, match="a key must be"):
        checked_key(3.5)
    with pytest.raises(TypeError, match="1-D integer tensor"):
        checked_key(torch.tensor([1.0]))


# ---------------------------------------------------------------- nodes and splits


class StateNode(Node):
    __slots__ = ("priority", "marker", "creation_time")
    split_copy = Node.split_copy + ("priority",)
    split_move = ("marker",)

    def __init__(self):
        super().__init__()
        self.priority = 0
        self.marker = None
        self.creation_time = "fresh"


def chain(page_size=1, extra=None):
    root = StateNode()
    root.hash_value = []
    a = StateNode()
    a.key = list(range(8))
    a.value = torch.arange(100, 108)
    a.parent = root
    a.extra_key = extra
    a.ck = child_key(a.key, 0, page_size, extra)
    root.children[a.ck] = a
    return root, a


def test_split_carries_every_declared_state():
    root, a = chain(page_size=2, extra="ns")
    a.lock_ref, a.last_access_time, a.hit_count, a.priority, a.marker = 2, 7.5, 3, 9, "stop"
    a.creation_time = "old"
    a.hash_value = ["h0", "h1", "h2", "h3"]
    grandchild = StateNode()
    grandchild.key = [50, 51]
    grandchild.parent = a
    a.children[(50, 51)] = grandchild
    up = split_node(a, 4, StateNode(), page_size=2)
    assert root.children == {("ns", (0, 1)): up}
    assert up.parent is root and up.children == {(4, 5): a} and a.parent is up
    assert up.key == [0, 1, 2, 3] and a.key == [4, 5, 6, 7]
    assert up.value.tolist() == [100, 101, 102, 103] and a.value.tolist() == [104, 105, 106, 107]
    assert up.ck == ("ns", (0, 1)) and a.ck == (4, 5) and up.extra_key == a.extra_key == "ns"
    assert (up.lock_ref, up.last_access_time, up.hit_count, up.priority) == (2, 7.5, 3, 9)
    assert (a.lock_ref, a.last_access_time, a.hit_count, a.priority) == (2, 7.5, 3, 9)
    assert up.marker == "stop" and a.marker is None  # moved
    assert up.creation_time == "fresh" and a.creation_time == "old"  # not declared: the constructor's
    assert up.hash_value == ["h0", "h1"] and a.hash_value == ["h2", "h3"]
    assert a.children == {(50, 51): grandchild} and up.id > a.id
    assert [x.key for x in iter_subtree(root)] == [[0, 1, 2, 3], [4, 5, 6, 7], [50, 51]]


def test_split_keeps_dict_position_and_unhashed_nodes():
    root = Node()
    first, a, last = Node([1], None, root, 1), Node([2, 3], torch.tensor([5, 6]), root, 2), Node([4], None, root, 4)
    for x in (first, a, last):
        root.children[x.ck] = x
    up = split_node(a, 1, Node())
    assert list(root.children.values()) == [first, up, last]
    assert up.hash_value is None and a.hash_value is None


def test_path_and_lock_walks():
    root, a = chain()
    up = split_node(a, 3, StateNode())
    path = path_to_root(a, root)
    assert path == [a, up]
    newly: list = []
    assert lock_path(path, newly) == 8 and newly == [a, up]
    newly = []
    assert lock_path([up], newly) == 0 and newly == []
    check_locked(path, a)
    freed: list = []
    assert unlock_path(path, freed) == 5 and freed == [a]
    with pytest.raises(ValueError, match="not locked; was this lock already released"):
        check_locked(path, a, "dec_lock_ref")
    assert unlock_path([up]) == 3
    # Taken out of the tree, or under another root.
    a.parent = None
    with pytest.raises(ValueError, match="inc_lock_ref: .* is not in this cache's tree"):
        path_to_root(a, root, "inc_lock_ref")
    with pytest.raises(ValueError, match="not in this cache's tree"):
        path_to_root(up, StateNode())
    assert path_to_root(root, root) == []


# ---------------------------------------------------------------- LRU lists


class Linked(Node):
    __slots__ = ("prev", "next", "w_prev", "w_next", "w_lock")

    def __init__(self, name=""):
        super().__init__([name] if name else [])
        self.prev = self.next = self.w_prev = self.w_next = None
        self.w_lock = 0


def test_lru_list_ops():
    lru = LRUList(Linked, "prev", "next", "lock_ref", "full LRU")
    window = LRUList(Linked, "w_prev", "w_next", "w_lock", "window LRU")
    a, b, c = Linked("a"), Linked("b"), Linked("c")
    for x in (a, b, c):
        lru.add_mru(x)
    assert list(lru) == [a, b, c] and len(lru) == 3 and a in lru and None not in lru
    assert a not in window  # separate links
    lru.touch(a)
    assert list(lru) == [b, c, a]
    lru.remove(c)
    assert list(lru) == [b, a] and c not in lru and len(lru) == 2
    with pytest.raises(AssertionError, match="is not in the full LRU"):
        lru.remove(c)
    with pytest.raises(AssertionError, match="already in the full LRU"):
        lru.add_mru(a)
    b.lock_ref = 1
    assert lru.lru_unlocked() is a and lru.prev_unlocked(a) is None
    b.lock_ref = 0
    assert lru.lru_unlocked() is b and lru.prev_unlocked(b) is a
    b.children = {0: c}
    assert lru.lru_unlocked(leaf_only=True) is a and lru.lru_unlocked() is b
    window.add_mru(a)
    a.w_lock = 1
    assert window.lru_unlocked() is None and lru.lru_unlocked(leaf_only=True) is a


def test_lru_touch_path_orders_parents_older_and_skips_non_members():
    lru = LRUList(Linked, lock="lock_ref")
    root = Linked()
    p, mid, leaf, other = Linked("p"), Linked("mid"), Linked("leaf"), Linked("o")
    mid.parent, leaf.parent, p.parent = p, mid, root
    for x in (leaf, p, other):
        lru.add_mru(x)  # mid is not in this list
    lru.touch_path(leaf, root)
    assert list(lru) == [other, p, leaf] and mid not in lru


@pytest.mark.parametrize("limit", [0, 1, 4, 5, 8, 9, 12, 13, 100, None])
def test_lru_touch_path_with_a_token_limit_touches_only_the_deepest_part(limit):
    def build():
        lru = LRUList(Linked, lock="lock_ref")
        root = Linked()
        nodes = {name: Linked(name) for name in ("p", "mid", "leaf", "o")}
        for name in ("p", "mid", "leaf"):
            nodes[name].key = [0] * 4
        nodes["mid"].parent, nodes["leaf"].parent, nodes["p"].parent = nodes["p"], nodes["mid"], root
        for name in ("p", "leaf", "o"):
            lru.add_mru(nodes[name])  # mid is not in this list (its tokens still count)
        names = {id(x): name for name, x in nodes.items()}
        return lru, root, nodes["leaf"], names

    lru, root, leaf, names = build()
    lru.touch_path(leaf, root, limit)
    # Reference (SGLang's "last W + page tokens" touch): walk up while fewer than `limit`
    # tokens were passed, then touch the picked nodes root side first.
    ref, ref_root, x, ref_names = build()
    picked, acc = [], 0
    while x is not ref_root and (limit is None or acc < limit):
        if x in ref:
            picked.append(x)
        acc += len(x.key)
        x = x.parent
    for x in reversed(picked):
        ref.touch(x)
    got = [names[id(x)] for x in lru]
    assert got == [ref_names[id(x)] for x in ref]
    if limit == 0:
        assert got == ["p", "leaf", "o"]  # nothing touched
    elif limit is not None and limit <= 8:
        assert got == ["p", "o", "leaf"]  # the leaf alone: p lies past the limit
    else:
        assert got == ["o", "p", "leaf"]  # the whole path, the child more recent than its parent


# ---------------------------------------------------------------- events


def test_page_hash_chaining_is_stable_and_namespaced():
    tokens = list(range(8))
    hashes = chain_page_hashes(tokens, 4, None, None)
    assert hashes == [page_hash(tokens[:4], None, None), page_hash(tokens[4:], hashes[0], None)]
    # Pinned values: the hash is a wire format (KV-aware routers compare it across processes).
    assert page_hash([1, 2, 3], None, None) == "e2e2033ae7e19d680599d4eb0a1359a2b48ec5baac75066c317fbf85159c54ef"
    ns = chain_page_hashes(tokens, 4, None, "lora-1")
    assert ns == [
        "e3b556a2f25f9ca693208ea3f6ea5668109cffbb26dfd1cadd4320d8f73e3b82",
        "7b9e1fae67c72a49c0ffd61640e718a6233ee739a42fa225b6e8a86474969c21",
    ]
    assert ns != hashes and ns == chain_page_hashes(tokens, 4, None, "lora-1")
    assert chain_page_hashes(tokens, 4, None, "lora-2") != ns
    # Chaining on a parent: the second page alone, chained on the first, equals the whole chain's tail.
    assert chain_page_hashes(tokens[4:], 4, ns[0], "lora-1") == ns[1:]


def test_record_stored_and_removed_follow_the_tree():
    root, a = chain(page_size=4, extra="ns")
    events: list = []
    record_stored(events, a, 4)
    assert a.hash_value == chain_page_hashes(a.key, 4, None, "ns")
    assert events == [
        PageStored(a.hash_value[0], None, (0, 1, 2, 3), "ns"),
        PageStored(a.hash_value[1], a.hash_value[0], (4, 5, 6, 7), "ns"),
    ]
    child = StateNode()
    child.key, child.parent, child.extra_key = [8, 9, 10, 11], a, "ns"
    events.clear()
    record_stored(events, child, 4)
    assert child.hash_value == chain_page_hashes(list(range(12)), 4, None, "ns")[2:]
    assert events[0].parent_hash == a.hash_value[-1]
    events.clear()
    record_removed(events, child)
    assert events == [PageRemoved(child.hash_value[0])]
    record_removed(events, StateNode())  # nothing hashed: nothing recorded
    assert len(events) == 1 and AllPagesCleared().kind == "cleared"


def test_package_exports_are_documented():
    doc = kt.__doc__
    for name in kt.__all__:
        assert name in doc, f"kvcore.tree.{name} is not described in the package docstring"


# ---------------------------------------------------------------- a tree from the kit alone


class ToyTree:
    """The walk of the package docstring, plus an insert: a minimal tree backend's core."""

    def __init__(self, page_size):
        self.ps = page_size
        self.root = Node([], torch.empty(0, dtype=torch.int64))

    def walk(self, ids, extra_key=None):
        ps, n = self.ps, len(ids) - len(ids) % self.ps
        node, pos = self.root, 0
        while pos < n:
            child = node.children.get(child_key(ids, pos, ps, extra_key if pos == 0 else None))
            if child is None:
                break
            end = pos + len(child.key)
            if end <= n and ids[pos:end] == child.key:
                node, pos = child, end
                continue
            m = prefix_match_len(ids, pos, child.key, n - pos, ps)
            node = split_node(child, m, Node(), ps)
            pos += m
            break
        return node, pos, n

    def insert(self, ids, extra_key=None):
        node, pos, n = self.walk(ids, extra_key)
        if pos < n:
            ck = child_key(ids, pos, self.ps, extra_key if pos == 0 else None)
            leaf = Node(ids[pos:n], torch.arange(pos, n), node, ck, extra_key)
            node.children[ck] = leaf
        return pos

    def match(self, ids, extra_key=None):
        node, pos, _ = self.walk(ids, extra_key)
        return pos


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_toy_tree_from_the_kit_matches_a_reference(page_size):
    rng = random.Random(7)
    tree = ToyTree(page_size)
    seen: list[tuple[str | None, list[int]]] = []
    for _ in range(300):
        extra = rng.choice([None, "a"])
        if seen and rng.random() < 0.6:
            base = rng.choice(seen)[1]
            ids = base[: rng.randrange(len(base) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(12))]
        else:
            ids = [rng.randrange(3) for _ in range(rng.randrange(1, 20))]
        # The longest page-aligned prefix shared with anything inserted before in the same namespace.
        best = max((reference_len(ids, 0, k, len(ids), page_size) for e, k in seen if e == extra), default=0)
        # The read-only walk finds the same length and changes nothing.
        shape = [(x.id, len(x.key)) for x in iter_subtree(tree.root)]
        n = len(ids) - len(ids) % page_size
        path, pos, inside, m = descend(tree.root, ids, n, page_size, extra)
        assert pos + m == best and [(x.id, len(x.key)) for x in iter_subtree(tree.root)] == shape
        assert [t for x in path for t in x.key] == ids[:pos]
        if inside is None:
            assert m == 0
        else:
            assert 0 < m < len(inside.key) and m == edge_match_len(ids, pos, inside.key, n, page_size)
        assert all(edge_match_len(ids, sum(len(y.key) for y in path[:i]), x.key, n, page_size) == len(x.key)
                   for i, x in enumerate(path))
        assert tree.match(ids, extra) == best
        assert tree.insert(ids, extra) == best
        seen.append((extra, ids[: len(ids) - len(ids) % page_size]))
    for node in iter_subtree(tree.root):
        assert node.parent.children[node.ck] is node and len(node.key) % page_size == 0 and node.key


def test_descend_edge_cases():
    root = Node([], torch.empty(0, dtype=torch.int64))
    assert descend(root, [], 0) == ([], 0, None, 0)
    assert descend(root, [1, 2], 2) == ([], 0, None, 0)
    a = Node([1, 2, 3, 4], torch.arange(4), root, 1)
    root.children[1] = a
    assert descend(root, [1, 2, 3, 4, 5], 4) == ([a], 4, None, 0)
    assert descend(root, [1, 2, 9, 9], 4) == ([], 0, a, 2)
    assert descend(root, [1, 2, 9, 9], 4, page_size=2) == ([], 0, None, 0)  # no edge starts with (1, 2)
    with pytest.raises(TypeError):
        descend(root, [[1], 2], 2)  # unhashable: reported by check_token_ids


def test_value_helpers():
    empty = torch.empty(0, dtype=torch.int64)
    a, b = torch.arange(3), torch.arange(3, 5)
    assert join_values([], empty) is empty and join_values([a], empty) is a
    assert join_values([a, b], empty).tolist() == [0, 1, 2, 3, 4]
    root, x = chain()
    y = Node([9, 9], torch.tensor([7, 8]), x, 9)
    x.children[9] = y
    assert path_values(root, root, empty) is empty and path_values(x, root, empty) is x.value
    assert path_values(y, root, empty).tolist() == list(range(100, 108)) + [7, 8]
    assert checked_value([1, 2, 3], 4, 3, "cpu").tolist() == [1, 2, 3]
    assert checked_value(torch.tensor([1, 2], dtype=torch.int32), 2, 2, "cpu").dtype == torch.int64
    with pytest.raises(TypeError, match="1-D integer tensor"):
        checked_value(torch.ones(2), 2, 2, "cpu")
    with pytest.raises(TypeError, match="got str"):
        checked_value("ab", 2, 2, "cpu")
    with pytest.raises(ValueError, match=r"value has 2 slots but the key has 5 tokens \(4 page-aligned\)"):
        checked_value([1, 2], 5, 4, "cpu")


def test_tree_lines_lists_depth_first_in_children_order():
    root = Node()
    a, b = Node([1], None, root, 1), Node([2], None, root, 2)
    c = Node([3], None, a, 3)
    root.children = {1: a, 2: b}
    a.children = {3: c}
    assert tree_lines(root, lambda x: str(x.key[0])) == ["1", "  3", "2"]
    assert tree_lines(Node()) == []


def test_request_ids_and_alloc_value():
    class R:
        rid = "r1"
        fill_ids = [5, 6, 7]

    assert request_ids(R(), 2) == [5, 6] and request_ids(R(), 3) == [5, 6, 7]
    with pytest.raises(ValueError, match="request 'r1' has 3 tokens but kv_committed_len=4"):
        request_ids(R(), 4)

    class Pool:
        def __init__(self, free):
            self.free = free

        def alloc(self, n):
            if n > self.free:
                return None
            self.free -= n
            return torch.arange(n)

    assert alloc_value(Pool(4), 3).tolist() == [0, 1, 2]
    with pytest.raises(RuntimeError, match="cannot allocate 5 slots for insert\\(value=None\\)"):
        alloc_value(Pool(4), 5)


def test_kv_event_log_takes_and_clears():
    class Log(KVEventLog):
        def __init__(self, on):
            self.enable_kv_events, self._events = on, []

    log = Log(True)
    log._events.append(PageRemoved("h"))
    log.record_cleared()
    assert log.take_events() == [PageRemoved("h"), AllPagesCleared()] and log.take_events() == []
    off = Log(False)
    off.record_cleared()
    assert off.take_events() == []

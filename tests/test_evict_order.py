"""kvcore.tree.EvictOrder: the maintained eviction order gives exactly the per-call heap's victims."""

from __future__ import annotations

import heapq
import itertools
import random
from typing import Any

import pytest

from kvcore.tree import BUILTIN_POLICIES, EvictionStrategy, EvictOrder, resolve_policy
from kvcore.tree.policies import LRUStrategy, MRUStrategy


class Leaf:
    """The four fields the built-in policies read, and an id."""

    _ids = itertools.count()

    def __init__(self, now: float, priority: int = 0) -> None:
        self.id = next(self._ids)
        self.last_access_time = now
        self.creation_time = now
        self.hit_count = 0
        self.priority = priority

    def __repr__(self) -> str:
        return f"<leaf {self.id}>"


class RecentFirst:
    """A plugin policy that is no EvictionStrategy: not monotone, ties oldest first."""

    def get_priority(self, node: Any) -> float:
        return -node.last_access_time


class DecliningHits(EvictionStrategy):
    """A subclass that keeps the default: not monotone (more hits, lower priority)."""

    def get_priority(self, node: Any) -> tuple[int, float]:
        return (-node.hit_count, node.last_access_time)


def per_call_heap_victims(policy: Any, members: set, k: int, tie: int, adds: dict) -> list:
    """Today's eviction: a heap of every member, built now; ``adds[i]`` joins after the i-th victim."""
    get = policy.get_priority
    heap = [(get(x), tie * x.id, x) for x in members]
    heapq.heapify(heap)
    out = []
    while heap and len(out) < k:
        x = heapq.heappop(heap)[2]
        members.discard(x)
        out.append(x)
        new = adds.get(len(out))
        if new is not None:
            members.add(new)
            heapq.heappush(heap, (get(new), tie * new.id, new))
    return out


POLICIES = [*sorted(BUILTIN_POLICIES), "recent-first", "declining-hits"]


def make_policy(name: str) -> Any:
    if name == "recent-first":
        return RecentFirst()
    if name == "declining-hits":
        return DecliningHits()
    return resolve_policy(name)


def test_monotone_is_declared_per_policy():
    declared = {name: BUILTIN_POLICIES[name]().monotone for name in BUILTIN_POLICIES}
    assert declared == {"lru": True, "lfu": True, "fifo": True, "mru": False, "filo": True,
                        "priority": True, "slru": True}
    assert EvictionStrategy.monotone is False
    assert EvictOrder(RecentFirst()).monotone is False
    assert EvictOrder(DecliningHits()).monotone is False


@pytest.mark.parametrize("name", POLICIES)
@pytest.mark.parametrize("seed", range(4))
def test_same_victims_as_a_per_call_heap_over_random_ops(name, seed):
    rng = random.Random(f"{name}-{seed}")
    policy = make_policy(name)
    tie = -1 if isinstance(policy, EvictionStrategy) and policy.newest_first else 1
    order = EvictOrder(policy)
    members: set = set()
    nodes: list[Leaf] = []
    clock = itertools.count(1)
    for _ in range(600):
        op = rng.random()
        if op < 0.3 or not nodes:
            x = Leaf(next(clock), rng.randrange(3))
            nodes.append(x)
            members.add(x)
            order.add(x)
        elif op < 0.45:  # a lock: out of the set, back later with its key grown meanwhile
            x = rng.choice(nodes)
            members.discard(x)
            order.discard(x)
        elif op < 0.6:
            x = rng.choice(nodes)
            members.add(x)
            order.add(x)
        elif op < 0.85:  # a match or an insert touching the node: every key either grows or (mru) falls
            for x in rng.sample(nodes, min(len(nodes), rng.randrange(1, 6))):
                x.last_access_time = next(clock)
                x.hit_count += rng.randrange(2)
                x.priority = max(x.priority, rng.randrange(4))
        else:
            k = rng.randrange(1, 6)
            adds = {i: Leaf(next(clock)) for i in range(1, k + 1) if rng.random() < 0.3}  # parents left childless
            nodes.extend(adds.values())
            want = per_call_heap_victims(policy, members, k, tie, adds)
            order.refresh()
            got = []
            for i in range(1, k + 1):
                x = order.pop()
                if x is None:
                    break
                got.append(x)
                if i in adds:
                    order.add(adds[i])
            assert got == want
        assert set(order) == members and len(order) == len(members)
        assert all(x in order for x in members)
        assert order.heap_size <= 2 * len(order) + 64


def test_a_touched_entry_is_re_keyed_when_it_surfaces():
    order = EvictOrder(LRUStrategy())
    a, b, c = Leaf(1), Leaf(2), Leaf(3)
    for x in (a, b, c):
        order.add(x)
    a.last_access_time = 10  # touched after being pushed: its stored key (1) is stale
    assert order.heap_size == 3
    assert [order.pop(), order.pop()] == [b, c]
    assert order.heap_size == 1 and len(order) == 1  # a went back in at key 10
    assert order.pop() is a and order.pop() is None and not order


def test_parked_entries_are_revived_skipped_and_compacted():
    order = EvictOrder(LRUStrategy())
    nodes = [Leaf(t) for t in range(1000)]
    for x in nodes:
        order.add(x)
    for _ in range(3):  # lock / unlock churn: the entries are parked and revived, never pushed again
        order.difference_update(nodes[:400])
        for x in nodes[:400]:
            order.add(x)
        assert order.heap_size == 1000 == len(order)
    nodes[1].last_access_time = 5000  # touched while locked: revived with its old key, re-keyed when it surfaces
    order.discard(nodes[1])
    order.add(nodes[1])
    for x in nodes[:900]:
        order.discard(x)  # given children: their entries stay parked until a rebuild drops them
        assert order.heap_size <= 2 * len(order) + 64
    assert order.heap_size < 1000  # rebuilt from the live ones at least once
    order.discard(nodes[950])
    order.discard(nodes[950])  # twice: no-op
    assert nodes[900] in order and nodes[950] not in order
    assert [order.pop() for _ in range(3)] == nodes[900:903]
    order.add(nodes[0])  # back, with its old key: evicted first again
    assert order.pop() is nodes[0]
    order.add(nodes[1])
    assert nodes[1] not in [order.pop() for _ in range(96)]  # 903..999 but 950 go first
    assert order.pop() is nodes[1] and order.pop() is None
    order.difference_update(nodes)
    assert len(order) == 0 and order.pop() is None
    order.add(nodes[5])
    order.clear()
    assert order.pop() is None and order.heap_size == 0


def test_iteration_is_in_insertion_order():
    order = EvictOrder(LRUStrategy())
    nodes = [Leaf(5 - t) for t in range(5)]
    for x in nodes:
        order.add(x)
    order.add(nodes[0])  # already there: stays in place
    assert list(order) == nodes


def test_a_non_monotone_policy_is_re_ranked_by_refresh():
    order = EvictOrder(MRUStrategy())
    a, b = Leaf(1), Leaf(2)
    order.add(a)
    order.add(b)
    a.last_access_time = 3  # mru: a's priority fell below b's
    order.refresh()
    assert order.pop() is a
    assert order.pop() is b and order.pop() is None

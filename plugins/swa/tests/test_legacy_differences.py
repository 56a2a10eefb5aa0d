"""Where ``swa`` answers otherwise than SGLang's legacy ``SWARadixCache``, one small scenario each.

``swa`` is the core's one tree with components (full, swa), so it answers as SGLang
0.5.19's ``UnifiedRadixCache`` with those components, not as the legacy ``SWARadixCache``
it used to follow.  Each scenario (window W = 4, page size 1) is run on ``swa`` and its
answers are pinned (``NEW``); with SGLang's source (``$KVCORE_SGLANG_SRC``) the same
operations also run on SGLang's ``UnifiedRadixCache`` (full, swa), which must answer
``NEW`` too, and on its legacy ``SWARadixCache``, which must answer ``LEGACY``: the
difference the README of kvcore-swa lists is still there, and it is this one.

The random differentials (``plugins/unified/tests/test_sglang_unified_differential.py``, both
names) compare everything else with SGLang's ``UnifiedRadixCache``.
"""

from __future__ import annotations

import pytest

import kvcore
from kvcore import InvariantChecker, RadixKey
from tools.differential import load_or_skip
from tools.sglang_unified_shim import default_src, load_sglang_unified

W, SIZE, SWA_SIZE = 4, 256, 128
SRC = default_src()


class Side:
    """One cache driven by token keys: ``swa`` (kvcore), ``unified`` or ``legacy`` (SGLang's)."""

    def __init__(self, kind: str, sg=None):
        self.kind, self.sg = kind, sg
        if kind == "swa":
            self.cache = kvcore.create_cache("swa", size=SIZE, swa_size=SWA_SIZE, sliding_window_size=W,
                                             page_size=1, max_num_reqs=2, max_context_len=64)
            self.alloc = self.cache.token_to_kv_pool_allocator
            return
        self.alloc = sg.make_swa_allocator(SIZE, SWA_SIZE, 1)
        rtp = sg.make_req_to_token_pool(2, 64)
        if kind == "legacy":
            self.cache = sg.make_radix_cache(self.alloc, rtp, 1, W)
        else:
            self.cache = sg.make_unified_cache(("full", "swa"), self.alloc, rtp, 1, window=W)

    def avail(self) -> tuple[int, int]:
        return self.alloc.full_available_size(), self.alloc.swa_available_size()

    def gain(self, before: tuple[int, int]) -> tuple[int, int]:
        after = self.avail()
        return after[0] - before[0], after[1] - before[1]

    def sizes(self) -> tuple[int, int, int, int]:
        c = self.cache
        return c.full_evictable_size(), c.full_protected_size(), c.swa_evictable_size(), c.swa_protected_size()

    def insert(self, key: list[int], swa_evicted_seqlen: int = 0) -> None:
        slots = self.alloc.alloc(len(key))
        if self.kind == "swa":
            self.cache.insert(RadixKey(key), slots, 0, swa_evicted_seqlen)
            return
        sg = self.sg
        if swa_evicted_seqlen:  # SGLang's caller frees the window slots below the cursor first
            self.alloc.free_swa(slots[:swa_evicted_seqlen])
        self.cache.insert(sg.InsertParams(key=sg.RadixKey(list(key)), value=slots,
                                          swa_evicted_seqlen=swa_evicted_seqlen))

    def match(self, key: list[int]) -> tuple[int, object]:
        if self.kind == "swa":
            m = self.cache.match_prefix(RadixKey(key))
        else:
            m = self.cache.match_prefix(self.sg.MatchPrefixParams(key=self.sg.RadixKey(list(key))))
        return int(m.device_indices.numel()), m.last_device_node

    def lock(self, key: list[int]) -> tuple[object, object]:
        node = self.match(key)[1]
        return node, self.cache.inc_lock_ref(node)

    def unlock(self, held: tuple[object, object]) -> None:
        node, lock = held
        if self.kind == "swa":
            self.cache.dec_lock_ref(node, lock)
        else:
            self.cache.dec_lock_ref(node, self.sg.DecLockRefParams(swa_uuid_for_lock=lock.swa_uuid_for_lock,
                                                                   skip_lock_node_ids=lock.skip_lock_node_ids))

    def unlock_window(self, held: tuple[object, object]) -> None:
        node, lock = held
        if self.kind == "swa":
            self.cache.dec_swa_lock_only(node, lock)
        elif self.kind == "legacy":
            self.cache.dec_swa_lock_only(node, lock.swa_uuid_for_lock)
        else:
            self.cache.dec_swa_lock_only(node, lock.swa_uuid_for_lock, lock.skip_lock_node_ids)

    def evict(self, num_tokens: int, swa_num_tokens: int) -> tuple[int, int]:
        if self.kind == "swa":
            r = self.cache.evict(num_tokens, swa_num_tokens)
        else:
            r = self.cache.evict(self.sg.EvictParams(num_tokens=num_tokens, swa_num_tokens=swa_num_tokens))
        return r.num_tokens_evicted, r.swa_num_tokens_evicted


def toks(*ranges: tuple[int, int]) -> list[int]:
    return [t for lo, hi in ranges for t in range(lo, hi)]


def _tombstone_under_two_leaves(s: Side) -> None:
    """[0, 8) shared by two 4-token leaves, its window side evicted while both leaves were locked."""
    s.insert(toks((0, 8), (50, 54)))
    s.insert(toks((0, 8), (60, 64)))
    held = [s.lock(toks((0, 8), (50, 54))), s.lock(toks((0, 8), (60, 64)))]
    assert s.evict(0, 8) == (0, 8)
    for h in held:
        s.unlock(h)


# Each scenario returns its answers; sizes are (full evictable, full protected, window evictable,
# window protected), gains what (full, window) pools got back.


def lock_a_long_new_leaf(s: Side):
    """An 8-token insert, then a lock on its end: how much window it holds."""
    s.insert(toks((0, 8)))
    s.lock(toks((0, 8)))
    return s.sizes()


def insert_with_its_whole_window_gone(s: Side):
    """A 4-token insert whose ``swa_evicted_seqlen`` is 4: what is kept, what a match finds."""
    before = s.avail()
    s.insert(toks((0, 4)), swa_evicted_seqlen=4)
    held = s.gain(before)
    return s.sizes(), (-held[0], -held[1]), s.match(toks((0, 4)))[0]


def full_eviction_uncovers_a_tombstone(s: Side):
    """Full eviction of the two leaves below a tombstone: does the tombstone go too?"""
    _tombstone_under_two_leaves(s)
    before = s.avail()
    answer = s.evict(8, 0)
    return answer, s.gain(before), s.sizes()


def window_eviction_uncovers_a_tombstone(s: Side):
    """Window eviction of the two leaves below a tombstone: the answer and what the pools got."""
    _tombstone_under_two_leaves(s)
    before = s.avail()
    answer = s.evict(0, 8)
    return answer, s.gain(before), s.sizes()


def window_eviction_of_a_chain(s: Side):
    """Inserts of 8 then 16 tokens, then a window eviction of 16."""
    s.insert(toks((0, 8)))
    s.insert(toks((0, 16)))
    before = s.avail()
    answer = s.evict(0, 16)
    return answer, s.gain(before), s.sizes()


def window_eviction_beside_a_locked_leaf(s: Side):
    """Inserts of 8 then 16 tokens, the 16-token key locked, then a window eviction of 16."""
    s.insert(toks((0, 8)))
    s.insert(toks((0, 16)))
    s.lock(toks((0, 16)))
    before = s.avail()
    answer = s.evict(0, 16)
    return answer, s.gain(before), s.sizes()


def early_window_unlock_of_a_leaf(s: Side):
    """``dec_swa_lock_only`` on a leaf its full lock still holds: freed at once, or evictable?"""
    s.insert(toks((0, 8)))
    held = s.lock(toks((0, 8)))
    before = s.avail()
    s.unlock_window(held)
    return s.gain(before), s.sizes()


def partial_full_eviction(s: Side):
    """Three 8-token inserts, then a full eviction of 12: what each key still matches."""
    for base in (100, 200, 300):
        s.insert(toks((base, base + 8)))
    before = s.avail()
    answer = s.evict(12, 0)
    return answer, s.gain(before), [s.match(toks((b, b + 8)))[0] for b in (100, 200, 300)]


# scenario: (swa's answers, which are SGLang's UnifiedRadixCache's; SGLang's legacy SWARadixCache's)
CASES = {
    # A window lock holds one window: the new leaf is cut one window (4) below its end.
    "lock_a_long_new_leaf": (lock_a_long_new_leaf, (0, 8, 4, 4), (0, 8, 0, 8)),
    # The full slots are kept as a stateless leaf (no match ends there); legacy keeps nothing.
    "insert_with_its_whole_window_gone": (insert_with_its_whole_window_gone,
                                          ((4, 0, 0, 0), (4, 0), 0), ((0, 0, 0, 0), (0, 0), 0)),
    # The uncovered tombstone stays (a stateless leaf) until full eviction asks again; legacy deletes it.
    "full_eviction_uncovers_a_tombstone": (full_eviction_uncovers_a_tombstone,
                                           ((8, 8), (8, 8), (8, 0, 0, 0)), ((16, 8), (16, 8), (0, 0, 0, 0))),
    # Legacy deletes the uncovered tombstone too but leaves its 8 full slots out of the answer.
    "window_eviction_uncovers_a_tombstone": (window_eviction_uncovers_a_tombstone,
                                             ((8, 8), (8, 8), (8, 0, 0, 0)), ((8, 8), (16, 8), (0, 0, 0, 0))),
    # Legacy: one 8-token leaf deleted, the tombstone above it too, answer 8 for a gain of 16.
    # Now: the 4-token leaf goes whole, the three nodes above keep their full slots (stateless).
    "window_eviction_of_a_chain": (window_eviction_of_a_chain,
                                   ((4, 16), (4, 16), (12, 0, 0, 0)), ((8, 16), (16, 16), (0, 0, 0, 0))),
    # The lock holds one window (the 4-token leaf), so 12 window slots can go rather than 8.
    "window_eviction_beside_a_locked_leaf": (window_eviction_beside_a_locked_leaf,
                                             ((0, 12), (0, 12), (0, 16, 0, 4)), ((0, 8), (0, 8), (0, 16, 0, 8))),
    # The window slots stay, evictable; legacy frees them at once.
    "early_window_unlock_of_a_leaf": (early_window_unlock_of_a_leaf, ((0, 0), (0, 8, 8, 0)), ((0, 8), (0, 8, 0, 0))),
    # Nodes are cut at one window, so the eviction takes 12 (the oldest key, half the next), not two whole keys.
    "partial_full_eviction": (partial_full_eviction, ((12, 12), (12, 12), [0, 4, 8]), ((16, 16), (16, 16), [0, 0, 8])),
}


def _norm(answers):
    return tuple(_norm(a) for a in answers) if isinstance(answers, (tuple, list)) else answers


@pytest.mark.parametrize("name", list(CASES))
def test_swa_answers_as_the_unified_tree(name):
    scenario, new, _ = CASES[name]
    side = Side("swa")
    assert _norm(scenario(side)) == _norm(new)
    side.cache.sanity_check()
    InvariantChecker(side.cache).check()


@pytest.fixture(scope="module")
def sg():
    if SRC is None:
        pytest.skip("SGLang source not found (set KVCORE_SGLANG_SRC)")
    return load_or_skip(load_sglang_unified, SRC, "UnifiedRadixCache")


@pytest.mark.parametrize("name", list(CASES))
def test_sglang_unified_tree_agrees_and_its_legacy_tree_differs(sg, name):
    scenario, new, legacy = CASES[name]
    assert _norm(new) != _norm(legacy)
    ours = Side("swa")
    assert _norm(scenario(ours)) == _norm(new)
    assert _norm(scenario(Side("unified", sg))) == _norm(new)
    assert _norm(scenario(Side("legacy", sg))) == _norm(legacy)
    InvariantChecker(ours.cache).check()

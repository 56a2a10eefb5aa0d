"""``swa`` (the one tree, components full + swa) against SGLang 0.5.23's ``UnifiedRadixCache`` (FULL, SWA).

kvcore's trees answer as SGLang 0.5.19's by default; built with ``split_recency="keep"`` they answer
as 0.5.23's, whose split leaves the lower part's place in the window LRU (0.5.19's moves both parts
to the front).  That is the one difference these operations find between the two releases' trees.

Seeded random direct operations (insert, with part of the window already gone; match, with the
matched node sometimes locked; unlock; the window lock given back early; evict of either pool) run
through SGLang 0.5.23's own tree, on its Python tree core and on its Rust one, and through
kvcore's ``swa``, side by side.  After every operation every answer must agree (insert prefix
lengths, matched lengths and slots, evict counts), then both pools' free sizes and every
component's evictable/protected sizes; on the Python core, which keeps Python nodes, also the whole
tree (paths, slots, window tombstones, both lock counts), the window LRU order and the evictable
leaves by recency.  The request path of hybrid models is not
driven here: kvcore-sglang serves no hybrid model on 0.5.23 (see the plugin README).

Slots are compared through a pairing made at allocation time (ours -> SGLang's).
"""

from __future__ import annotations

import random
from array import array
from collections import Counter
from typing import Any

import pytest
import torch
from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.base_swa_memory_pool import BaseSWAKVPool
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixKey as SKey
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang.srt.runtime_context import get_context

from kvcore import InvariantChecker, RadixKey, create_cache
from tools.differential import ids, lru_order, path_tokens, tree_rows

FULL, SWA = ComponentType.FULL, ComponentType.SWA


class _NoBuffers(BaseSWAKVPool):
    """The KV pool SGLang's SWA allocator is built over, without buffers: the tree never reads K/V."""

    def __init__(self) -> None:
        self.full_kv_pool = self.swa_kv_pool = None
        self.full_to_swa_index_mapping: torch.Tensor | None = None

    def register_mapping(self, mapping: torch.Tensor) -> None:
        self.full_to_swa_index_mapping = mapping

    def translate_loc_from_full_to_swa(self, kv_indices: torch.Tensor) -> torch.Tensor:
        assert self.full_to_swa_index_mapping is not None
        return self.full_to_swa_index_mapping[kv_indices].to(torch.int32)

    def get_state_buf_infos(self) -> list:
        return []

    def get_key_buffer(self, layer_id: int) -> None:
        raise AssertionError("the tree reads no K/V")

    get_value_buffer = get_kv_buffer = set_kv_buffer = get_key_buffer


@pytest.fixture(autouse=True)
def scheduler_context():
    with get_context().override_server_args():
        yield


class Diff:
    def __init__(self, *, seed: int, page_size: int, window: int, size: int, swa_size: int, core: str):
        self.rng = random.Random(f"swa-0.5.23-{core}-{page_size}-{window}-{seed}")
        self.ps, self.W, self.size, self.python_core = page_size, window, size, core == "python"
        # split_recency="keep": SGLang 0.5.23's split leaves the lower part's LRU place (0.5.19's refreshes it).
        self.ours = create_cache("swa", size=size, swa_size=swa_size, sliding_window_size=window,
                                 page_size=page_size, max_num_reqs=4, max_context_len=256, split_recency="keep")
        self.oa = self.ours.token_to_kv_pool_allocator
        self.sa = SWATokenToKVPoolAllocator(size, swa_size, page_size, torch.float16, "cpu", _NoBuffers(), False)
        init = CacheInitParams(disable=False, req_to_token_pool=ReqToTokenPool(4, 256, "cpu", False),
                               token_to_kv_pool_allocator=self.sa, page_size=page_size, sliding_window_size=window,
                               tree_components=(FULL, SWA))
        init.tree_core_backend = core
        self.theirs = UnifiedRadixCache(init)
        self.pair = torch.full((size + 2 * page_size + 2,), -1, dtype=torch.int64)
        self.held: list[tuple[Any, Any, Any, Any]] = []
        self.log: list[str] = []
        self.ran: Counter[str] = Counter()  # operations that changed something, to show the run reached them
        self.checker = InvariantChecker(self.ours)

    # -- comparing
    def eq(self, what: str, ours: Any, theirs: Any) -> None:
        if ours != theirs:
            tail = "\n  ".join(self.log[-25:])
            pytest.fail(f"{what}: kvcore {ours!r} != SGLang 0.5.23 {theirs!r}\nlast operations:\n  {tail}")

    def mapped(self, slots: Any) -> list[int]:
        return [int(self.pair[int(s)]) for s in slots]

    def opath(self, node: Any) -> tuple:
        return path_tokens(node, self.ours.root_node)

    def spath(self, node: Any) -> tuple:
        return path_tokens(node, self.theirs.tree_core.root_node, lambda k: k.token_ids)

    def compare(self, what: str) -> None:
        o, t = self.ours, self.theirs
        self.eq(f"{what}: free sizes", (self.oa.full_available_size(), self.oa.swa_available_size()),
                (self.sa.full_available_size(), self.sa.swa_available_size()))
        self.eq(f"{what}: sizes", (o.full_evictable_size(), o.full_protected_size(), o.swa_evictable_size(),
                                   o.swa_protected_size()),
                (t.full_evictable_size(), t.full_protected_size(), t.swa_evictable_size(), t.swa_protected_size()))
        if self.python_core:
            ours = tree_rows(o.root_node, lambda n: (self.opath(n), n.swa_value is None, n.lock_ref, n.swa_lock_ref,
                                                     tuple(self.mapped(n.value))))

            def row(n: Any) -> tuple:
                f, s = n.component_data[FULL], n.component_data[SWA]
                return self.spath(n), s.value is None, f.lock_ref, s.lock_ref, ids(f.value)

            self.eq(f"{what}: trees", ours, tree_rows(t.tree_core.root_node, row))
            lru = t.tree_core.lru_lists[SWA]
            self.eq(f"{what}: window LRU order", [self.opath(n) for n in o.by_name["swa"].lru],
                    [self.spath(n) for n in lru_order(lru.head, lru.tail, lambda n: n.lru_prev[lru._pt])])
            core = t.tree_core
            self.eq(f"{what}: evictable leaves by recency",
                    [self.opath(n) for n in sorted(o.leaves, key=lambda n: n.last_access_time)],
                    [self.spath(n) for n in sorted(core.evictable_device_leaves, key=lambda n: n.last_access_time)])
        self.checker.check()

    # -- operations
    def room(self, n: int) -> bool:
        if self.oa.full_available_size() < n or self.oa.swa_available_size() < n:
            self.evict(max(0, n - self.oa.full_available_size()), max(0, n - self.oa.swa_available_size()))
        return self.oa.full_available_size() >= n and self.oa.swa_available_size() >= n

    def insert(self, key: list[int], gone_pages: int) -> None:
        n = len(key) // self.ps * self.ps
        if n == 0 or not self.room(n):
            return
        sev = min(gone_pages * self.ps, n)
        self.log.append(f"insert {key[:n]} swa_evicted_seqlen={sev}")
        if self.ps == 1:
            o, s = self.oa.alloc(n), self.sa.alloc(n)
        else:  # SGLang's paged SWA allocator hands out pages through alloc_extend only
            o = self.oa.alloc_extend([0], [0], [n], [n], [-1], n)
            s = self.sa.alloc_extend(*(torch.tensor([v]) for v in (0, 0, n, n, -1)), n)
        self.pair[o] = s
        if sev:  # the window slots below the cursor are gone before the insert, on SGLang's side the caller's job
            self.sa.free_swa(s[:sev])
        r = self.ours.insert(RadixKey(key[:n]), o, 0, sev)
        sr = self.theirs.insert(InsertParams(key=SKey(array("q", key[:n])), value=s, prev_prefix_len=0,
                                             component_evicted_seqlens={SWA: sev}))
        self.eq("insert prefix_len", r.prefix_len, sr.prefix_len)
        self.ran["insert, part of the window gone" if sev else "insert"] += 1
        self.compare("insert")

    def match(self, key: list[int], hold: bool) -> None:
        self.log.append(f"match {key} hold={hold}")
        m = self.ours.match_prefix(RadixKey(key))
        sm = self.theirs.match_prefix(MatchPrefixParams(key=SKey(array("q", key))))
        n = sm.device_prefix_len
        self.eq("match length", int(m.device_indices.numel()), n)
        self.eq("match slots", self.mapped(m.device_indices),
                self.theirs.path_device_indices(sm.last_device_node)[:n].tolist())
        if self.python_core:
            self.eq("match node", self.opath(m.last_device_node),
                    self.spath(self.theirs.tree_core.node_by_id(sm.last_device_node)))
        self.ran["match" if n else "miss"] += 1
        if hold and n:
            self.ran["lock"] += 1
            lock = self.ours.inc_lock_ref(m.last_device_node)
            self.held.append((m.last_device_node, lock, self.theirs.lock(sm.last_device_node), key))
        self.compare("match")

    def unlock(self, i: int) -> None:
        node, lock, tlock, key = self.held.pop(i)
        self.log.append(f"unlock {key}")
        self.ours.dec_lock_ref(node, lock)
        self.theirs.unlock(tlock)
        self.compare("unlock")

    def release_window(self, i: int) -> None:
        node, lock, tlock, key = self.held[i]
        if tlock.swa_released or tlock.receipt.component_lock_uuids.get(SWA) is None:
            return
        self.log.append(f"dec_swa_lock_only {key}")
        self.ours.dec_swa_lock_only(node, lock)
        self.theirs.release_swa(tlock)
        self.ran["window lock given back"] += 1
        self.compare("dec_swa_lock_only")

    def evict(self, n: int, swa_n: int) -> None:
        self.log.append(f"evict({n}, {swa_n})")
        r = self.ours.evict(n, swa_n)
        s = self.theirs.evict(EvictParams(num_tokens=n, swa_num_tokens=swa_n))
        self.compare("evict")
        self.eq("evict result", (r.num_tokens_evicted, r.swa_num_tokens_evicted),
                (s.num_tokens_evicted, s.swa_num_tokens_evicted))
        self.ran["full eviction"] += bool(r.num_tokens_evicted)
        self.ran["window eviction"] += bool(r.swa_num_tokens_evicted)

    def run(self, ops: int) -> None:
        rng, ps, W = self.rng, self.ps, self.W
        stems = [[rng.randrange(6) for _ in range(rng.randrange(ps, 4 * W + 4 * ps))] for _ in range(4)]
        stems.append(stems[0][: len(stems[0]) // 2] + [rng.randrange(6) for _ in range(2 * W)])
        for _ in range(ops):
            base = rng.choice(stems)
            key = base[: rng.randrange(1, len(base) + 1)] + [rng.randrange(6) for _ in range(rng.randrange(0, 2 * ps))]
            r = rng.random()
            if r < 0.35:
                pages = len(key) // ps
                self.insert(key, rng.choice([0, 0, rng.randrange(0, pages + 1)]) if pages else 0)
            elif r < 0.65:
                self.match(key, hold=rng.random() < 0.5)
            elif r < 0.73 and self.held:
                self.unlock(rng.randrange(len(self.held)))
            elif r < 0.82 and self.held:
                self.release_window(rng.randrange(len(self.held)))
            else:
                self.evict(rng.choice([0, 0, 1, ps, 3 * ps, 40]), rng.choice([0, 1, ps, 2 * W, 40]))
        while self.held:
            self.unlock(0)
        self.evict(self.size, self.size)
        self.eq("drained", self.oa.full_available_size(), self.size)


CONFIGS = [
    # page_size, window, full pool, window pool
    (1, 4, 160, 40),
    (1, 16, 320, 96),
    (4, 8, 256, 64),
]


@pytest.mark.parametrize("core", ["python", "rust"])
@pytest.mark.parametrize("ps, W, size, swa", CONFIGS)
@pytest.mark.parametrize("seed", range(3))
def test_swa_matches_sglang_0_5_23_unified_tree(core: str, ps: int, W: int, size: int, swa: int, seed: int) -> None:
    diff = Diff(seed=seed, page_size=ps, window=W, size=size, swa_size=swa, core=core)
    diff.run(150)
    kinds = ("insert", "insert, part of the window gone", "match", "miss", "lock", "full eviction", "window eviction")
    assert all(diff.ran[k] for k in kinds), diff.ran


def test_some_run_gives_a_window_lock_back_early() -> None:
    runs = [Diff(seed=seed, page_size=1, window=4, size=160, swa_size=40, core="python") for seed in range(3)]
    for diff in runs:
        diff.run(150)
    assert any(diff.ran["window lock given back"] for diff in runs), [diff.ran for diff in runs]

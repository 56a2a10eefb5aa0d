"""kvcore's one tree against SGLang 0.5.23's ``UnifiedRadixCache``, for the hybrid component sets.

kvcore's trees answer as SGLang 0.5.19's by default; built with ``split_recency="keep"`` they answer
as 0.5.23's, whose split leaves the lower part's place in each component's LRU (0.5.19's moves both
parts to the front).  That is the one difference these operations find between the two releases'
trees: with ``"refresh"`` the runs below fail.

Seeded random direct operations run through SGLang 0.5.23's own tree, on its Python tree core and
on its Rust one, and through kvcore's backend for the same components (``swa``: full + swa,
``mamba``: full + mamba, ``unified``: full + swa + mamba), side by side: inserts (part of the
window already gone; a state slot), matches (the matched node sometimes locked), unlocks, the
window lock given back early, evictions of every pool.  After every operation every answer must
agree (insert prefix lengths and ``mamba_exist``, matched lengths, slots and branching points,
evict counts), then every pool's free size and every component's evictable/protected sizes; on
the Python core, which keeps Python nodes, also the whole tree (paths, slots, window tombstones,
state slots, every lock count), each component's LRU order and the evictable leaves by recency.
Slots and state slots are compared through pairings made at allocation time (ours -> SGLang's).

The request path of hybrid models is not driven here: kvcore-sglang serves no hybrid model on
0.5.23 (see the plugin README).
"""

from __future__ import annotations

import random
import types
from array import array
from collections import Counter
from typing import Any

import pytest
import torch
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.base_swa_memory_pool import BaseSWAKVPool
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool, ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixKey as SKey
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang.srt.runtime_context import get_context, get_server_args

from kvcore import InvariantChecker, RadixKey, create_cache
from tools.differential import ids, lru_order, path_tokens, tree_rows

FULL, SWA, MAMBA = ComponentType.FULL, ComponentType.SWA, ComponentType.MAMBA
ROWS, WIDTH = 4, 256


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


def _state_shape() -> Any:
    """The model shape SGLang's ``MambaPool`` reads (a small one: a CPU holds every state)."""
    return types.SimpleNamespace(
        shape=types.SimpleNamespace(conv=[(6, 3)], temporal=(2, 4, 4), disable_conv_window_dedup=True),
        dtype=types.SimpleNamespace(conv=torch.float32, temporal=torch.float32),
        is_kda=False,
    )


@pytest.fixture(autouse=True)
def scheduler_context():
    with get_context().override_server_args():
        yield


BACKENDS = {("swa",): "swa", ("mamba",): "mamba", ("swa", "mamba"): "unified"}


class Diff:
    def __init__(self, parts: tuple[str, ...], *, seed: int, page_size: int, window: int, size: int,
                 swa_size: int, mamba_size: int, core: str):
        self.rng = random.Random(f"{'+'.join(parts)}-0.5.23-{core}-{page_size}-{window}-{seed}")
        self.swa, self.mamba = "swa" in parts, "mamba" in parts
        self.ps, self.W, self.size, self.python_core = page_size, window, size, core == "python"
        opts: dict[str, Any] = {"components": ("full", *parts)} if BACKENDS[parts] == "unified" else {}
        if self.swa:
            opts.update(swa_size=swa_size, sliding_window_size=window)
        # Pages of more than one token: SGLang's extra-buffer mode (ping-pong tracking slots), a chunk of one page.
        extra = self.mamba and page_size > 1
        if self.mamba:
            chunk = max(2, page_size)
            # The mamba component reads its chunk size from the published server args (a model config otherwise).
            get_server_args()._mamba_cache_chunk_size = chunk
            opts.update(mamba_size=mamba_size, mamba_cache_chunk_size=chunk)
            if extra:
                opts.update(mamba_track_interval=page_size)
        self.ours = create_cache(BACKENDS[parts], size=size, page_size=page_size, max_num_reqs=ROWS,
                                 max_context_len=WIDTH, split_recency="keep", **opts)
        self.oa = self.ours.token_to_kv_pool_allocator
        self.om = self.ours.mamba_pool if self.mamba else None
        if self.swa:
            self.sa: Any = SWATokenToKVPoolAllocator(size, swa_size, page_size, torch.float16, "cpu", _NoBuffers(),
                                                     False)
        elif page_size == 1:
            self.sa = TokenToKVPoolAllocator(size, torch.float16, "cpu", None, False)
        else:
            self.sa = PagedTokenToKVPoolAllocator(size, page_size, torch.float16, "cpu", None, False)
        if self.mamba:
            rows: Any = HybridReqToTokenPool(size=ROWS, mamba_size=mamba_size, mamba_spec_state_size=mamba_size,
                                             max_context_len=WIDTH, device="cpu", enable_memory_saver=False,
                                             cache_params=_state_shape(), mamba_layer_ids=[0, 1],
                                             enable_mamba_extra_buffer=extra, enable_overlap_schedule=True)
            self.sm = rows.mamba_allocator
        else:
            rows = ReqToTokenPool(ROWS, WIDTH, "cpu", False)
        init = CacheInitParams(disable=False, req_to_token_pool=rows, token_to_kv_pool_allocator=self.sa,
                               page_size=page_size, sliding_window_size=window if self.swa else None,
                               tree_components=(FULL, *(SWA,) * self.swa, *(MAMBA,) * self.mamba),
                               enable_mamba_extra_buffer=extra)
        init.tree_core_backend = core
        self.theirs = UnifiedRadixCache(init)
        self.pair = torch.full((size + 2 * page_size + 2,), -1, dtype=torch.int64)
        self.mpair = torch.full((mamba_size + 2,), -1, dtype=torch.int64)
        self.held: list[tuple[Any, Any, Any, Any]] = []
        self.inserted: list[list[int]] = []
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

    def _free(self) -> tuple[tuple, tuple]:
        ours, theirs = [self.oa.full_available_size() if self.swa else self.oa.available_size()], \
            [self.sa.full_available_size() if self.swa else self.sa.available_size()]
        if self.swa:
            ours.append(self.oa.swa_available_size())
            theirs.append(self.sa.swa_available_size())
        if self.mamba:
            ours.append(self.om.available_size())
            theirs.append(self.sm.available_size())
        return tuple(ours), tuple(theirs)

    def _sizes(self, cache: Any) -> tuple:
        out = [cache.full_evictable_size(), cache.full_protected_size()]
        if self.swa:
            out += [cache.swa_evictable_size(), cache.swa_protected_size()]
        if self.mamba:
            out += [cache.mamba_evictable_size(), cache.mamba_protected_size()]
        return tuple(out)

    def _our_row(self, n: Any) -> tuple:
        row: tuple = (self.opath(n), n.lock_ref, tuple(self.mapped(n.value)))
        if self.swa:
            row += (n.swa_value is None, n.swa_lock_ref)
        if self.mamba:
            row += (n.mamba_lock_ref, None if n.mamba_value is None else int(self.mpair[int(n.mamba_value[0])]))
        return row

    def _their_row(self, n: Any) -> tuple:
        f = n.component_data[FULL]
        row: tuple = (self.spath(n), f.lock_ref, ids(f.value))
        if self.swa:
            s = n.component_data[SWA]
            row += (s.value is None, s.lock_ref)
        if self.mamba:
            m = n.component_data[MAMBA]
            row += (m.lock_ref, None if m.value is None else int(m.value.reshape(-1)[0]))
        return row

    def compare(self, what: str) -> None:
        o, t = self.ours, self.theirs
        self.eq(f"{what}: free sizes", *self._free())
        self.eq(f"{what}: sizes", self._sizes(o), self._sizes(t))
        if self.python_core:
            core = t.tree_core
            self.eq(f"{what}: trees", tree_rows(o.root_node, self._our_row), tree_rows(core.root_node, self._their_row))
            for name, ct in (("swa", SWA), ("mamba", MAMBA)):
                if name in o.by_name:
                    lru, pt = core.lru_lists[ct], core.lru_lists[ct]._pt
                    self.eq(f"{what}: {name} LRU order", [self.opath(n) for n in o.by_name[name].lru],
                            [self.spath(n) for n in lru_order(lru.head, lru.tail, lambda n, pt=pt: n.lru_prev[pt])])
            self.eq(f"{what}: evictable leaves by recency",
                    [self.opath(n) for n in sorted(o.leaves, key=lambda n: n.last_access_time)],
                    [self.spath(n) for n in sorted(core.evictable_device_leaves, key=lambda n: n.last_access_time)])
        self.checker.check()

    # -- operations
    def room(self, n: int) -> bool:
        free = self._free()[0]
        want = (max(0, n - free[0]), max(0, n - free[1]) if self.swa else 0,
                int(self.mamba and free[-1] < 1))
        if any(want):
            self.evict(*want)
        free = self._free()[0]
        return free[0] >= n and (not self.swa or free[1] >= n) and (not self.mamba or free[-1] >= 1)

    def insert(self, key: list[int], gone_pages: int) -> None:
        n = len(key) // self.ps * self.ps
        if n == 0 or not self.room(n):
            return
        sev = min(gone_pages * self.ps, n) if self.swa else 0
        key = key[:n]
        self.log.append(f"insert {key} swa_evicted_seqlen={sev}")
        self.inserted.append(key)
        if self.ps == 1:
            o, s = self.oa.alloc(n), self.sa.alloc(n)
        else:  # SGLang's paged SWA allocator hands out pages through alloc_extend only
            o = self.oa.alloc_extend([0], [0], [n], [n], [-1], n)
            s = self.sa.alloc_extend(*(torch.tensor([v]) for v in (0, 0, n, n, -1)), n)
        self.pair[o] = s
        om = sm = None
        if self.mamba:
            om, sm = self.om.alloc(1), self.sm.alloc(1)
            self.mpair[om] = sm
        if sev:  # the window slots below the cursor are gone before the insert, on SGLang's side the caller's job
            self.sa.free_swa(s[:sev])
        r = self.ours.insert(RadixKey(key), o, 0, sev, mamba_value=om)
        sr = self.theirs.insert(InsertParams(key=SKey(array("q", key)), value=s, prev_prefix_len=0, mamba_value=sm,
                                             component_evicted_seqlens={SWA: sev} if self.swa else {}))
        self.eq("insert", (r.prefix_len, r.mamba_exist), (sr.prefix_len, sr.mamba_exist))
        if r.mamba_exist:  # the caller's state slot was not taken
            self.om.free(om)
            self.sm.free(sm)
        self.ran["insert, a state kept already" if r.mamba_exist else
                 "insert, part of the window gone" if sev else "insert"] += 1
        self.compare("insert")

    def match(self, key: list[int], hold: bool) -> None:
        self.log.append(f"match {key} hold={hold}")
        m = self.ours.match_prefix(RadixKey(key))
        sm = self.theirs.match_prefix(MatchPrefixParams(key=SKey(array("q", key))))
        n = sm.device_prefix_len
        self.eq("match length", int(m.device_indices.numel()), n)
        self.eq("match slots", self.mapped(m.device_indices),
                self.theirs.path_device_indices(sm.last_device_node)[:n].tolist())
        if self.mamba:
            self.eq("match branching", m.mamba_branching_seqlen, sm.mamba_branching_seqlen)
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

    def evict(self, n: int, swa_n: int, states: int) -> None:
        self.log.append(f"evict({n}, swa={swa_n}, mamba_num={states})")
        r = self.ours.evict(n, swa_n, mamba_num=states)
        s = self.theirs.evict(EvictParams(num_tokens=n, swa_num_tokens=swa_n, mamba_num=states))
        self.compare("evict")
        self.eq("evict result", (r.num_tokens_evicted, r.swa_num_tokens_evicted, r.mamba_num_evicted),
                (s.num_tokens_evicted, s.swa_num_tokens_evicted, s.mamba_num_evicted))
        self.ran["full eviction"] += bool(r.num_tokens_evicted)
        self.ran["window eviction"] += bool(r.swa_num_tokens_evicted)
        self.ran["state eviction"] += bool(r.mamba_num_evicted)

    def run(self, ops: int) -> None:
        rng, ps, W = self.rng, self.ps, self.W
        stems = [[rng.randrange(6) for _ in range(rng.randrange(ps, 4 * W + 4 * ps))] for _ in range(4)]
        stems.append(stems[0][: len(stems[0]) // 2] + [rng.randrange(6) for _ in range(2 * W)])
        for _ in range(ops):
            base = rng.choice(stems)
            # A state is kept where an insert ended: cut points repeat, so that matches reach them.
            key = base[: rng.choice([len(base), len(base) // 2 + 1, rng.randrange(1, len(base) + 1)])]
            if rng.random() < 0.3:
                key = key + [rng.randrange(6) for _ in range(rng.randrange(1, 2 * ps + 1))]
            r = rng.random()
            if r < 0.35:
                if self.inserted and rng.random() < 0.25:
                    key = rng.choice(self.inserted[-5:])  # a key again: its node may hold a state already
                pages = len(key) // ps
                self.insert(key, rng.choice([0, 0, rng.randrange(0, pages + 1)]) if pages else 0)
            elif r < 0.68:
                if self.inserted and rng.random() < 0.4:
                    key = rng.choice(self.inserted[-5:])  # a key that was cached, unless evicted since
                self.match(key, hold=rng.random() < 0.5)
            elif r < 0.76 and self.held:
                self.unlock(rng.randrange(len(self.held)))
            elif r < 0.84 and self.held and self.swa:
                self.release_window(rng.randrange(len(self.held)))
            else:
                self.evict(rng.choice([0, 0, 1, ps, 3 * ps, 40]), rng.choice([0, 1, ps, 2 * W, 40]) if self.swa else 0,
                           rng.choice([0, 1, 2, 5]) if self.mamba else 0)
        while self.held:
            self.unlock(0)
        self.evict(self.size, self.size if self.swa else 0, 10**6 if self.mamba else 0)
        self.eq("drained", self._free()[0][0], self.size)


# parts, page_size, window, full pool, window pool, state slots (mamba at page 4: SGLang's extra-buffer mode)
CONFIGS = [
    (("swa",), 1, 4, 160, 40, 0),
    (("swa",), 1, 16, 320, 96, 0),
    (("swa",), 4, 8, 256, 64, 0),
    (("mamba",), 1, 4, 96, 0, 10),
    (("mamba",), 1, 4, 160, 0, 24),
    (("mamba",), 4, 4, 256, 0, 12),
    (("swa", "mamba"), 1, 4, 160, 40, 12),
    (("swa", "mamba"), 1, 16, 320, 96, 24),
]
KINDS = {"swa": ("insert, part of the window gone", "window eviction"),
         "mamba": ("insert, a state kept already", "state eviction")}


@pytest.mark.parametrize("core", ["python", "rust"])
@pytest.mark.parametrize("parts, ps, W, size, swa, states", CONFIGS,
                         ids=lambda v: "+".join(v) if isinstance(v, tuple) else None)
@pytest.mark.parametrize("seed", range(3))
def test_hybrid_sets_match_sglang_0_5_23_unified_tree(core: str, parts: tuple[str, ...], ps: int, W: int, size: int,
                                                      swa: int, states: int, seed: int) -> None:
    diff = Diff(parts, seed=seed, page_size=ps, window=W, size=size, swa_size=swa, mamba_size=states, core=core)
    diff.run(150)
    kinds = ("insert", "match", "miss", "lock", "full eviction") + tuple(k for p in parts for k in KINDS[p])
    assert all(diff.ran[k] for k in kinds), diff.ran


def test_some_run_gives_a_window_lock_back_early() -> None:
    runs = [Diff(("swa",), seed=seed, page_size=1, window=4, size=160, swa_size=40, mamba_size=0, core="python")
            for seed in range(3)]
    for diff in runs:
        diff.run(150)
    assert any(diff.ran["window lock given back"] for diff in runs), [diff.ran for diff in runs]

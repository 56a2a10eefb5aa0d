"""A backend with a pool of a kind the core has never heard of shows up in the checker and the bench.

The throwaway ``scratch`` backend below is a complete third-party distribution:
each running request holds one slot of a ``scratch`` pool (in its record's
``components``), and the cache keeps the scratch slot of the last finished
request as a cached, evictable entry.  Nothing in kvcore knows the name.
"""

import json
import os
import subprocess
import sys

import pytest

import kvcore
from kvcore import InvariantChecker, InvariantViolation
from kvcore.plugins import reset_plugins
from kvcore.testing import admit, decode, finish, make_req, prefill
from kvcore.testing.distributions import make_dist

SCRATCH = '''
import torch
import kvcore
from kvcore.pools import TokenToKVPoolAllocator


class ScratchConfig(kvcore.CacheConfig):
    scratch_size: int = 4


class ScratchCache(kvcore.ChunkCache):
    """Chunk cache plus one scratch slot per running request; keeps the last finished one cached."""

    def __init__(self, params):
        super().__init__(params)
        self.scratch = TokenToKVPoolAllocator(params.config.scratch_size)
        self.kept = None  # the cached scratch slot (evictable)

    def pools(self):
        def record_slots(kv):
            slot = kv.components.get("scratch")
            if slot is None:
                return torch.empty((0,), dtype=torch.int64), 0
            return slot, 1
        return super().pools() + [kvcore.PoolView("scratch", self.scratch, record_slots=record_slots)]

    def cached_sizes(self):
        return {**super().cached_sizes(), "scratch": (0 if self.kept is None else 1, 0)}

    def iter_owned_slots(self):
        if self.kept is not None:
            yield kvcore.SlotOwner("scratch", "the kept scratch slot", self.kept)

    def evict(self, num_tokens, scratch_num=0):
        result = super().evict(num_tokens)
        if scratch_num and self.kept is not None:
            self.scratch.free(self.kept)
            self.kept = None
        return result

    def cache_unfinished_req(self, req, chunked=False):
        super().cache_unfinished_req(req, chunked)
        if "scratch" not in req.kv.components:
            slot = self.scratch.alloc(1)
            if slot is None:
                self.evict(0, scratch_num=1)
                slot = self.scratch.alloc(1)
            if slot is not None:
                req.kv.components["scratch"] = slot

    def cache_finished_req(self, req, is_insert=True):
        super().cache_finished_req(req, is_insert)
        slot = req.kv.components.pop("scratch", None)
        if slot is not None:
            if self.kept is not None:
                self.scratch.free(self.kept)
            self.kept = slot


@kvcore.hookimpl
def kvcore_register_backends(register):
    register("scratch", ScratchCache, config=ScratchConfig, description="a pool of its own kind", reference="chunk")
'''


@pytest.fixture
def scratch_site(tmp_path, monkeypatch):
    make_dist(tmp_path, "scratch-kv", "scratch_kv", SCRATCH)
    monkeypatch.syspath_prepend(str(tmp_path))
    reset_plugins()
    yield tmp_path
    reset_plugins()


def _run(cache, rid, prompt, out_tokens=2):
    req = make_req(rid, prompt)
    assert admit(cache, req)
    assert prefill(cache, req, upto=len(prompt) // 2)  # a chunk: the scratch slot is taken here
    assert prefill(cache, req)
    decode(cache, req, out_tokens)
    return req


def test_a_new_pool_kind_is_checked_without_a_core_change(scratch_site):
    cache = kvcore.create_cache("scratch", size=64, max_num_reqs=4, max_context_len=32)
    assert [p.name for p in cache.pools()] == ["full", "scratch"]
    a = _run(cache, "a", list(range(10)))
    b = _run(cache, "b", list(range(20, 28)))
    reports = {r.pool: r for r in InvariantChecker(cache).check([a, b])}
    assert reports["scratch"].total == 4 and reports["scratch"].uncached == 2 and reports["scratch"].balanced
    finish(cache, a)
    reports = {r.pool: r for r in InvariantChecker(cache).check([b])}
    assert reports["scratch"].evictable == 1 and reports["scratch"].uncached == 1
    finish(cache, b)
    (full, scratch) = InvariantChecker(cache).check([])
    assert scratch.available == 3 and scratch.evictable == 1 and full.available == 64


def test_a_leak_in_the_new_pool_is_named(scratch_site):
    cache = kvcore.create_cache("scratch", size=64, max_num_reqs=4, max_context_len=32)
    req = _run(cache, "r", list(range(10)))
    lost = cache.scratch.alloc(1)
    with pytest.raises(InvariantViolation, match=rf"\[scratch\] slot {int(lost[0])} leaked"):
        InvariantChecker(cache).check([req])
    cache.scratch.free(lost)
    # A slot the request owns, freed behind its back.
    cache.scratch.free(req.kv.components["scratch"])
    with pytest.raises(InvariantViolation, match=r"\[scratch\] .* owned by request 'r' \(use after free\)"):
        InvariantChecker(cache).check([req])
    req.kv.components.pop("scratch")  # the request gives up the slot it no longer has
    finish(cache, req)
    InvariantChecker(cache).check([])


def test_a_new_pool_kind_shows_in_the_bench(scratch_site):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(scratch_site), env.get("PYTHONPATH", "")])
    out = subprocess.run(
        [sys.executable, "-m", "kvcore", "bench", "--backend", "scratch", "--num-requests", "12", "--json"],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    report = report[0] if isinstance(report, list) else report
    pools = {p["name"]: p for p in report["pools"]}
    assert set(pools) == {"full", "scratch"}
    assert pools["scratch"]["capacity"] == 4
    assert report["leaked_slots"] == 0


def test_reference_comes_from_the_spec(scratch_site):
    assert kvcore.available_backends()["scratch"].reference == "chunk"

"""Streamed trace replay: tokens made on arrival and dropped at finish, so memory follows what runs.

Also the synthetic Mooncake-like traces and the block-level infinite cache.
"""

from __future__ import annotations

import json
import random
import tracemalloc
from array import array

import pytest

import kvcore
from kvcore.bench import run_bench
from kvcore.bench.infinite import BlockInfiniteCache, InfiniteCache
from kvcore.bench.spec import VOCAB, token_list
from kvcore.bench.trace import BLOCK_TOKENS, TRACE_PRESETS, generate_mooncake_like, load_trace, sample_trace_path

INSTALLED = kvcore.available_backends()
BACKEND = "radix" if "radix" in INSTALLED else "chunk"


def _write_trace(path, n: int, seed: int = 0) -> None:
    """n requests over 8 shared one-block documents, each plus 0-1 private blocks, short outputs."""
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        ids = [rng.randrange(8)] + ([1000 + i] if rng.random() < 0.5 else [])
        n_in = len(ids) * BLOCK_TOKENS - rng.randrange(BLOCK_TOKENS // 2)
        lines.append(json.dumps({"timestamp": i * 15, "input_length": n_in, "output_length": rng.randint(4, 24),
                                 "hash_ids": ids}))
    path.write_text("\n".join(lines) + "\n")


def _peak(path, n: int) -> tuple[int, dict]:
    tracemalloc.start()
    try:
        (rep,) = run_bench([BACKEND], workload="trace", trace=str(path), num_requests=n, size=8192, max_num_reqs=16,
                           chunk_size=1024)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak, rep


def test_memory_does_not_grow_with_trace_length(tmp_path):
    p = tmp_path / "t.jsonl"
    _write_trace(p, 1500)
    _peak(p, 20)  # warm imports and caches outside the measurement
    short, rep_s = _peak(p, 150)
    long, rep_l = _peak(p, 1500)
    assert rep_l["prompt_tokens"] > 9 * rep_s["prompt_tokens"]
    for rep in (rep_s, rep_l):
        assert rep["leaked_slots"] == 0 and rep["invariant_violations"] == 0
    # Tokens materialised up front cost 36 bytes a token as lists (8 as arrays): 10x the trace, 10x the
    # peak.  Streamed, only per-request metadata (hash ids, lengths: a few hundred bytes) and per-step
    # samples grow; the tokens in the pools and the tree are bounded by --size.
    grown = long - short
    extra_tokens = rep_l["prompt_tokens"] + rep_l["output_tokens"] - rep_s["prompt_tokens"] - rep_s["output_tokens"]
    assert grown < 0.05 * 36 * extra_tokens, (short, long)
    assert grown < 1024 * (1500 - 150), (short, long)


def test_streamed_requests_make_and_drop_their_tokens(tmp_path):
    wl = load_trace(None)
    assert all(not r.prompt and not r.output for r in wl.requests)
    for r in wl.requests:
        r.materialise()
    by_first: dict[int, list] = {}
    for r in wl.requests:
        assert isinstance(r.prompt, array) and len(r.prompt) == r.prompt_len and len(r.output) == r.output_len
        assert all(0 < t < VOCAB for t in r.prompt[:64])
        by_first.setdefault(r.recipe.ids[0], []).append(r)
    # equal first hash id -> equal first block; different ids -> different blocks
    groups = [g for g in by_first.values() if len(g) > 1 and g[0].prompt_len >= BLOCK_TOKENS]
    assert groups
    for g in groups:
        assert all(r.prompt[:BLOCK_TOKENS] == g[0].prompt[:BLOCK_TOKENS] for r in g if r.prompt_len >= BLOCK_TOKENS)
    firsts = [g[0].prompt[:BLOCK_TOKENS] for g in by_first.values() if g[0].prompt_len >= BLOCK_TOKENS]
    assert len({bytes(f) for f in firsts}) == len(firsts)
    # outputs are fresh per request; a different seed gives different tokens; the same seed the same
    assert len({bytes(r.output[:8]) for r in wl.requests}) == len(wl.requests)
    again = load_trace(None)
    other = load_trace(None, seed=1)
    again.requests[0].materialise()
    other.requests[0].materialise()
    assert again.requests[0].prompt == wl.requests[0].prompt != other.requests[0].prompt
    assert again.digest == wl.digest != other.digest
    wl.requests[0].release()
    assert not wl.requests[0].prompt and wl.requests[0].prompt_len == again.requests[0].prompt_len


def test_run_drops_every_streamed_request(tmp_path):
    wl_path = tmp_path / "t.jsonl"
    _write_trace(wl_path, 40)
    from kvcore.bench.loop import BenchConfig, run_workload

    wl = load_trace(str(wl_path))
    res = run_workload(BenchConfig(backend=BACKEND, size=8192, max_num_reqs=8, chunk_size=512), wl)
    assert res.leaked_slots == 0
    assert all(not r.prompt and not r.output for r in wl.requests)


@pytest.mark.parametrize("page", [1, 4])
def test_block_infinite_cache_agrees_with_the_token_tree(page):
    wl = load_trace(None, num_requests=120)
    blocks, tokens = BlockInfiniteCache(page), InfiniteCache(page)
    for r in wl.requests:
        r.materialise()
        want = tokens.match(list(r.prompt), r.prompt_len - 1)
        tokens.insert(list(r.prompt) + list(r.output))
        assert blocks.match_and_insert(r.recipe.prompt_blocks(), r.prompt_len - 1) == want
        r.release()


def test_synthetic_mooncake_trace_has_the_preset_statistics(tmp_path):
    p = tmp_path / "conv.jsonl"
    stats = generate_mooncake_like(p, "conversation", num_requests=400, seed=3)
    lines = [json.loads(x) for x in p.read_text().splitlines()]
    assert len(lines) == stats["requests"] == 400
    assert stats["mean_output"] == pytest.approx(TRACE_PRESETS["conversation"]["mean_output"], rel=0.05)
    assert all(len(x["hash_ids"]) == -(-x["input_length"] // BLOCK_TOKENS) for x in lines)
    assert [x["timestamp"] for x in lines] == sorted(x["timestamp"] for x in lines)
    assert 0 < stats["block_reuse"] < 1
    wl = load_trace(str(p))
    from kvcore.bench.loop import infinite_cache_hits

    assert infinite_cache_hits(wl, 1) == pytest.approx(stats["block_reuse"] * stats["prompt_tokens"], rel=0.01)
    with pytest.raises(ValueError, match="unknown trace preset"):
        generate_mooncake_like(p, "chat")


def test_token_list_interns_ids():
    a = token_list(array("q", [7, VOCAB - 1, 7]))
    b = token_list(array("q", [VOCAB - 1]))
    assert a == [7, VOCAB - 1, 7] and a[1] is b[0]
    assert token_list([1, 2]) == [1, 2] and token_list(array("q")) == []
    assert token_list(array("q", [VOCAB + 5])) == [VOCAB + 5]


def test_bad_hash_id_is_refused(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps({"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1 << 70]}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:1: field 'hash_ids'"):
        load_trace(str(p))
    assert sample_trace_path().is_file()

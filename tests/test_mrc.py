"""``kvcore mrc``: the curves against page-level reference simulations, an exhaustive optimum, the serving
loop's radix tree under LRU, and the command line.

The references below are deliberately naive (one cache simulation per size, page by page): the
module under test computes every size in one pass, so agreement checks the algorithm, not a copy of it.
"""

from __future__ import annotations

import bisect
import itertools
import json
import random
from collections import OrderedDict

import numpy as np
import pytest

from kvcore.bench import run_bench
from kvcore.bench.loop import infinite_cache_hits
from kvcore.bench.trace import sample_trace_path
from kvcore.bench.workloads import make_workload
from kvcore.mrc import compute_mrc
from kvcore.mrc.belady import optimal_hits
from kvcore.mrc.curve import lru_hits
from kvcore.mrc.paths import Path, workload_paths
from kvcore.mrc.stack import stack_pass

# ----------------------------------------------------------------------------- references


def _page_paths(paths: list[Path], ps: int) -> list[tuple[list[int], int]]:
    """Each path as page ids of a token-level trie (a page is its whole prefix), with its limit in pages."""
    ids: dict = {}
    out = []
    for p in paths:
        toks = [(sym, k) for sym, hi in zip(p.ids, p.his) for k in range(hi)]
        pages, parent = [], 0
        for j in range(0, len(toks), ps):
            parent = ids.setdefault((parent, tuple(toks[j : j + ps])), len(ids) + 1)
            pages.append(parent)
        out.append((pages, p.limit // ps))
    return out


def _prefix_hits(pages: list[int], limit: int, cache) -> int:
    h = 0
    for pg in pages[:limit]:
        if pg not in cache:
            break
        h += 1
    return h


def _ref_lru(pp, capacity: int) -> int:
    """A prefix-tree LRU cache of ``capacity`` pages: a request touches its path, parents last."""
    cache: OrderedDict = OrderedDict()
    hits = 0
    for pages, limit in pp:
        hits += _prefix_hits(pages, limit, cache)
        for pg in reversed(pages):
            cache[pg] = True
            cache.move_to_end(pg)
        while len(cache) > capacity:
            cache.popitem(last=False)
    return hits


def _ref_belady(pp, capacity: int) -> int:
    """Belady's MIN: keep the pages whose next use is soonest (deeper first among equals).  A page whose next
    access lies past that request's match limit is worth nothing until then (the access brings it back)."""
    uses: dict[int, list[int]] = {}
    counted: dict[int, list[bool]] = {}
    depth: dict[int, int] = {}
    for r, (pages, limit) in enumerate(pp):
        for d, pg in enumerate(pages):
            depth[pg] = d
            uses.setdefault(pg, []).append(r)
            counted.setdefault(pg, []).append(d < limit)
    cache: set[int] = set()
    hits = 0
    for r, (pages, limit) in enumerate(pp):
        hits += _prefix_hits(pages, limit, cache)
        cache.update(pages)

        def nxt(pg, r=r):
            u = uses[pg]
            k = bisect.bisect_right(u, r)
            return u[k] if k < len(u) and counted[pg][k] else 1 << 60

        cache = set(sorted(cache, key=lambda pg: (nxt(pg), depth[pg]))[:capacity])
    return hits


def _exhaustive_optimum(pp, capacity: int) -> int:
    """The best reuse over every choice of prefix-closed cache contents after every request."""
    parent: dict[int, int] = {}
    for pages, _ in pp:
        for a, b in zip([0] + pages, pages):
            parent[b] = a

    best_from: dict = {}

    def go(r: int, cache: frozenset) -> int:
        if r == len(pp):
            return 0
        key = (r, cache)
        if key in best_from:
            return best_from[key]
        pages, limit = pp[r]
        gain = _prefix_hits(pages, limit, cache)
        pool = sorted(cache | set(pages))
        best = 0
        for k in range(min(capacity, len(pool)) + 1):
            for keep in itertools.combinations(pool, k):
                ks = set(keep)
                if all(parent[x] == 0 or parent[x] in ks for x in ks):
                    best = max(best, go(r + 1, frozenset(ks)))
        best_from[key] = gain + best
        return gain + best

    return go(0, frozenset())


CASES = [("zipf", 24, 1), ("zipf", 24, 16), ("multi-turn", 16, 4), ("shared-prefix", 24, 8), ("trace", 40, 64)]


@pytest.mark.parametrize("name, n, ps", CASES)
def test_curves_equal_page_level_references(name, n, ps):
    wl = make_workload(name, seed=1, num_requests=n)
    paths = list(workload_paths(wl, ps))
    reuse = stack_pass(paths)
    pp = _page_paths(paths, ps)
    sizes = np.array(sorted({ps * k for k in (1, 2, 5, 13, 40, 120, 400, 1500, 6000, 30000)}))
    assert lru_hits(reuse, sizes).tolist() == [ps * _ref_lru(pp, s // ps) for s in sizes]
    assert optimal_hits(reuse, sizes).tolist() == [ps * _ref_belady(pp, s // ps) for s in sizes]


class _Own:
    """A symbol equal only to itself (a request's fresh tokens)."""


def _block_paths(rng: random.Random, n: int, block: int, ps: int) -> list[Path]:
    """Trace-like paths: blocks of ``block`` tokens from a small alphabet, the last one often partial (a whole
    number of pages), then the request's own tokens -- the splits inside blocks that Mooncake lines cause."""
    out = []
    for _ in range(n):
        k = rng.randint(1, 5)
        ids: list = [rng.choice("abcd") for _ in range(k)]
        his = [block] * k
        his[-1] = rng.choice([block, ps * rng.randint(1, block // ps)])
        if rng.random() < 0.7:
            ids.append(_Own())
            his.append(ps * rng.randint(1, 3))
        total = sum(his)
        out.append(Path(ids, his, rng.randint(0, total // ps) * ps, total))
    return out


@pytest.mark.parametrize("seed, ps", [(s, ps) for s in range(6) for ps in (1, 2)])
def test_partial_blocks_split_as_the_token_tree(seed, ps):
    """A path that ends inside a block another path passes through whole (and the reverse) splits the block:
    the one-pass curves still equal the page-by-page references on the expanded tokens."""
    paths = _block_paths(random.Random(seed), 40, 8, ps)
    reuse = stack_pass(paths)
    pp = _page_paths(paths, ps)
    sizes = np.array([ps * k for k in (1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144)])
    assert lru_hits(reuse, sizes).tolist() == [ps * _ref_lru(pp, s // ps) for s in sizes]
    assert optimal_hits(reuse, sizes).tolist() == [ps * _ref_belady(pp, s // ps) for s in sizes]


def _tiny_paths(rng: random.Random) -> list[Path]:
    """Short paths over a 3-letter alphabet: shared prefixes, divergence, exact repeats."""
    out = []
    for _ in range(6):
        k = rng.randint(1, 4)
        ids = [rng.choice("abc") for _ in range(k)]
        out.append(Path(ids, [1] * k, rng.randint(0, k), k))
    return out


@pytest.mark.parametrize("seed", range(12))
def test_optimum_is_the_exhaustive_best_prefix_closed_cache(seed):
    """The claim in kvcore/mrc/belady.py: the interval greedy reaches the best any prefix-closed cache can."""
    paths = _tiny_paths(random.Random(seed))
    reuse = stack_pass(paths)
    pp = _page_paths(paths, 1)
    sizes = np.array([1, 2, 3, 4])
    opt = optimal_hits(reuse, sizes).tolist()
    assert opt == [_exhaustive_optimum(pp, c) for c in sizes.tolist()]
    assert all(o >= lr for o, lr in zip(opt, lru_hits(reuse, sizes).tolist()))


@pytest.mark.parametrize("name, n, ps", [("zipf", 200, 1), ("multi-turn", 120, 1), ("trace", None, 16),
                                         ("shared-prefix", 200, 4), ("no-reuse", 50, 1)])
def test_optimal_never_below_lru_and_ceiling_above_both(name, n, ps):
    wl = make_workload(name, seed=0, num_requests=n)
    c = compute_mrc(wl, ps, points=60)
    lru, opt = c.lru_tokens, c.optimal_tokens
    assert np.all(opt >= lru), "the optimum fell below LRU"
    assert np.all(opt <= c.infinite_tokens) and np.all(lru <= c.infinite_tokens)
    assert np.all(np.diff(lru) >= 0) and np.all(np.diff(opt) >= 0), "a curve is not monotone"
    assert np.all(np.diff(c.sizes) > 0) and np.all(c.sizes % ps == 0)
    assert lru[-1] == c.infinite_tokens  # the grid ends where LRU reaches the ceiling
    if name != "no-reuse":
        assert np.any(opt > lru)  # not trivially equal
    # The ceiling is the bench's infinite cache, token for token.
    if wl.requests[0].session_id is None:
        assert c.infinite_tokens == infinite_cache_hits(wl, ps)


# ------------------------------------------------------------------- against the serving loop


def _sim(n: int, size: int, max_num_reqs: int) -> dict:
    return run_bench(["radix"], workload="zipf", num_requests=n, size=size, max_num_reqs=max_num_reqs,
                     eviction_policy="lru")[0]


N_SIM = 150


@pytest.fixture(scope="module")
def zipf_curve():
    wl = make_workload("zipf", seed=0, num_requests=N_SIM)
    c = compute_mrc(wl, 1, points=200)
    return wl, c


def _lru_at(wl, *sizes: int) -> dict[int, int]:
    """Reused tokens of the LRU curve at ``sizes``."""
    c = compute_mrc(wl, 1, points=1, extra_sizes=list(sizes))
    return {int(s): int(v) for s, v in zip(c.sizes, c.lru_tokens)}


def test_lru_curve_equals_simulated_radix_lru_one_request_at_a_time(zipf_curve):
    """docs/bench.md "Agreement with the simulator": served one at a time, the tree holds between
    S - L and S of the most recently used tokens (L: the longest leaf, at most the longest request,
    whole leaves being evicted), so LRU(S - L) <= simulated(S) <= LRU(S), with equality wherever the
    curve is flat over that range -- while the tree still evicts."""
    wl, c = zipf_curve
    L = wl.max_total_len
    # Sizes where the curve is flat over [S - L, S] and still below the ceiling: eviction costs reuse there.
    below = _lru_at(wl, *[int(s) - L for s in c.sizes if s > L])
    flat = [int(s) for s, v in zip(c.sizes, c.lru_tokens)
            if s > L and v < c.infinite_tokens and below[int(s) - L] == v]
    assert flat, "no size where the curve is flat over [S - L, S] below the ceiling"
    exact = flat[0]
    rep = _sim(N_SIM, exact, 1)
    assert rep["evictions"] > 0
    assert rep["cached_tokens"] == _lru_at(wl, exact)[exact] < c.infinite_tokens
    for size in (8192,):
        got = _sim(N_SIM, size, 1)["cached_tokens"]
        at = _lru_at(wl, size - L, size)
        assert at[size - L] <= got <= at[size], size


def test_concurrent_requests_stay_between_the_documented_bounds(zipf_curve):
    """With many running requests their locked prefixes and their own KV take room an LRU cache of the
    same size would use otherwise: simulated(S) lies between LRU(S - R - L) (R: the peak slots held by
    running requests) and the optimum at S."""
    wl, c = zipf_curve
    L = wl.max_total_len
    for size in (16384, 65536):
        rep = _sim(N_SIM, size, 128)
        held = rep["pools"][0]["peak"]
        low = max(1, size - held - L)
        assert _lru_at(wl, low)[low] <= rep["cached_tokens"]
        opt = compute_mrc(wl, 1, points=1, extra_sizes=[size])
        assert rep["cached_tokens"] <= int(opt.optimal_tokens[list(opt.sizes).index(size)])


# ------------------------------------------------------------------------------ the command


def _main(capsys, *args):
    from kvcore.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["mrc", *args])
    out = capsys.readouterr()
    return exc.value.code, out.out, out.err


def _ok(capsys, *args) -> str:
    from kvcore.cli import main

    main(["mrc", *args])
    out = capsys.readouterr()
    return out.out


def test_json_schema(capsys):
    doc = json.loads(_ok(capsys, "--workload", "zipf", "-n", "40", "--page-size", "4", "--points", "16", "--json"))
    for key, kind in (("page_size", int), ("sizes", list), ("lru", list), ("optimal", list), ("infinite", float),
                      ("requests", int), ("prompt_tokens", int)):
        assert isinstance(doc[key], kind), key
    assert doc["page_size"] == 4 and doc["requests"] == 40
    assert doc["sizes"] == sorted(doc["sizes"]) and len(set(doc["sizes"])) == len(doc["sizes"])
    assert len(doc["lru"]) == len(doc["optimal"]) == len(doc["sizes"]) <= 16
    assert all(0 <= a <= b <= doc["infinite"] <= 1 for a, b in zip(doc["lru"], doc["optimal"]))
    assert doc["cached_tokens"]["lru"][-1] == doc["cached_tokens"]["infinite"]
    assert doc["lru"][-1] == pytest.approx(doc["infinite"])


def test_trace_and_simulated_points(capsys, tmp_path):
    png = tmp_path / "mrc.png"
    doc = json.loads(_ok(capsys, "--trace", str(sample_trace_path()), "-n", "60", "--page-size", "16", "--json",
                         "--simulate", "radix:lru,radix:lfu", "--sizes", "16K,32K", "--plot", str(png)))
    assert doc["workload"] == "trace" and doc["requests"] == 60
    assert {16384, 32768} <= set(doc["sizes"])
    pts = doc["simulated"]
    assert [(p["label"], p["size"]) for p in pts] == [
        ("radix lru", 16384), ("radix lru", 32768), ("radix lfu", 16384), ("radix lfu", 32768)]
    for p in pts:
        k = doc["sizes"].index(p["size"])
        assert p["lru"] == doc["lru"][k] and p["optimal"] == doc["optimal"][k]
        assert 0 <= p["hit_rate"] <= min(p["optimal"], doc["infinite"])
        assert (p["lower_bound"] is None) == (p["eviction_policy"] != "lru")
        assert p["lower_bound"] is None or p["lower_bound"] <= p["hit_rate"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--workload", "bogus"], "bogus"),
        (["--trace", "/no/such/file.jsonl"], "/no/such/file.jsonl"),
        (["--workload", "zipf", "--trace", str(sample_trace_path())], "--trace"),
        (["--trace", str(sample_trace_path()), "--page-size", "48"], "512"),
        (["-w", "zipf", "-n", "5", "--sizes", "16K"], "--simulate"),
        (["-w", "zipf", "-n", "5", "--simulate", "radix", "--sizes", "lots"], "lots"),
        (["-w", "zipf", "-n", "5", "--simulate", "nope:lru", "--sizes", "16K"], "nope"),
        (["-w", "zipf", "-n", "5", "--simulate", "radix:bogus", "--sizes", "16K"], "bogus"),
        (["-w", "zipf", "-n", "5", "--page-size", "16", "--simulate", "radix", "--sizes", "1000"], "1000"),
        (["-w", "zipf", "-n", "5", "--plot", "out.txt"], "png"),
        (["-w", "zipf", "-n", "5", "--model", "gpt-9"], "gpt-9"),
        (["-w", "zipf", "--page-size", "0"], "page-size"),
    ],
)
def test_cli_bad_input_is_one_line(capsys, args, needle):
    code, out, err = _main(capsys, *args)
    assert code not in (0, None)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("kvcore: error:") and needle in lines[0], lines[0]
    assert out == ""

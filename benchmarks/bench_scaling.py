"""How kvcore's costs grow with the work: chunked prefill against prompt length, eviction against tree size.

Two measurements, each on the kvcore found on ``sys.path`` (so one run can compare two
checkouts, alternating, with ``--compare DIR_A DIR_B``):

* **prompt**: one prompt of L tokens through ``kvcore.Engine`` in 8K-token chunks
  (``cache_unfinished_req`` per chunk), then finish; ns per prompt token, for each L.
* **evict**: a tree of N leaves (one 16-token page each, page size 16, LRU), then
  repeated ``evict(16)`` calls, each after a fresh leaf is inserted; ms per call, for each N.

    python benchmarks/bench_scaling.py                          # this checkout
    python benchmarks/bench_scaling.py --compare /old/tree .    # two checkouts, alternating sides
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def prompt_cost(backend: str, length: int, chunk: int) -> float:
    import kvcore
    from kvcore.testing import make_req

    cache = kvcore.create_cache(backend, size=length + 4 * chunk, page_size=16, max_num_reqs=4,
                                max_context_len=length + 16)
    engine = kvcore.Engine(cache)
    req = make_req("p", [1 + (i * 7919) % 50000 for i in range(length)])
    t = time.perf_counter()
    assert engine.admit(req)
    while req.kv.kv_committed_len < length:
        assert engine.extend(req, req.kv.kv_committed_len + chunk)
    engine.finish(req)
    return (time.perf_counter() - t) / length * 1e9


def evict_cost(leaves: int, calls: int) -> float:
    import kvcore

    page = 16
    cache = kvcore.create_cache("radix", size=(leaves + calls + 8) * page, page_size=page, max_num_reqs=4,
                                max_context_len=64)
    alloc = cache.token_to_kv_pool_allocator
    for i in range(leaves):
        cache.insert([i + 1] * page, alloc.alloc(page))
    spent = 0.0
    for j in range(calls):
        cache.insert([leaves + j + 1] * page, alloc.alloc(page))
        t = time.perf_counter()
        cache.evict(page)
        spent += time.perf_counter() - t
    return spent / calls * 1e3


def measure(args: argparse.Namespace) -> dict:
    out: dict = {"prompt_ns_per_token": {}, "evict_ms_per_call": {}}
    for backend in args.backends.split(","):
        out["prompt_ns_per_token"][backend] = {
            str(n): prompt_cost(backend, n, args.chunk) for n in args.prompt_lens}
    out["evict_ms_per_call"]["radix"] = {str(n): evict_cost(n, args.evict_calls) for n in args.tree_sizes}
    return out


def _side(root: str, argv: list[str]) -> dict:
    paths = [root] + [os.path.join(root, d, p) for d in ("plugins",) for p in sorted(os.listdir(os.path.join(root, d)))]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
    res = subprocess.run([sys.executable, os.path.abspath(__file__), *argv, "--json"], env=env, cwd="/",
                         capture_output=True, text=True, check=True)
    return json.loads(res.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backends", default="radix,unified")
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[8192, 32768, 131072])
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--tree-sizes", type=int, nargs="+", default=[1000, 10000, 30000])
    ap.add_argument("--evict-calls", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=2, help="with --compare: rounds, each side once per round")
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if not args.compare:
        result = measure(args)
        print(json.dumps(result, indent=2) if args.json else result)
        return
    argv = [a for a in sys.argv[1:] if a not in args.compare and a != "--compare"]
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    for _ in range(args.rounds):  # alternating sides: a noisy machine hits both alike
        runs["before"].append(_side(args.compare[0], argv))
        runs["after"].append(_side(args.compare[1], argv))
    table = []
    for what in ("prompt_ns_per_token", "evict_ms_per_call"):
        for backend, per in runs["before"][0][what].items():
            for size in per:
                b = statistics.median(r[what][backend][size] for r in runs["before"])
                a = statistics.median(r[what][backend][size] for r in runs["after"])
                table.append((what, backend, size, b, a, a / b))
    if args.json:
        print(json.dumps([dict(zip(("what", "backend", "size", "before", "after", "after_over_before"), row))
                          for row in table], indent=2))
        return
    print(f"{'measure':<22} {'backend':<8} {'size':>8} {'before':>10} {'after':>10} {'after/before':>12}")
    for what, backend, size, b, a, r in table:
        print(f"{what:<22} {backend:<8} {size:>8} {b:>10.1f} {a:>10.1f} {r:>12.2f}")


if __name__ == "__main__":
    main()

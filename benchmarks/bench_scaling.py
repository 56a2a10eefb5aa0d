#!/usr/bin/env python
"""How the costs grow with the work: chunked prefill against prompt length, eviction against tree size.

kvcore's backends (``--backends``, default ``radix,unified``) and SGLang 0.5.19's own
``RadixCache`` (``--sglang-src``, loaded as ``benchmarks/bench_radix.py`` loads it, through
``tools/sglang_loader.py``: SGLang's tree, allocator and request table code, run on the CPU)
side by side, in one process:

* **prompt** (ns per prompt token, for each prompt length L, ``--prompt-lens``): one prompt
  of L tokens through chunked prefill in ``--chunk``-token chunks, then finish.  kvcore:
  ``kvcore.Engine`` with the README's loop (admit; while ``kv_committed_len < len(fill_ids)``,
  ``extend`` per chunk: slots by ``alloc_extend``, the row write,
  ``cache_unfinished_req``; ``finish``).  SGLang: the same steps on its own classes and a
  minimal request stand-in (``SGReq`` of ``tools/sglang_loader.py``: the fields SGLang's
  caches read): ``match_prefix`` + ``inc_lock_ref`` + a row; per chunk its paged
  ``alloc_extend``, the row write and its own ``RadixCache.cache_unfinished_req(req,
  chunked=...)`` (which inserts the whole page-aligned prefix and matches it again); then
  ``cache_finished_req`` and the row back.
* **evict** (ms per call, for each tree size N, ``--tree-sizes``): a tree of N leaves (one
  16-token page each under the root, page size 16, LRU), then ``--evict-calls`` rounds of
  "insert one fresh leaf, time one ``evict(16)``".  Only the evict call is timed.  After the
  run the allocators' free lists are compared with SGLang's (``same_victims``): equal free
  lists mean the same victims, evicted in the same order.

Every figure is the best of ``--repeat`` runs (more, up to 8, for sizes far below the
largest, whose runs are short), in this process's CPU time (``--clock wall`` for elapsed
time); the runs of the caches alternate.  ``--max-len`` / ``--max-leaves`` drop larger sizes
(512K tokens through SGLang takes a while); ``--no-sglang`` runs kvcore alone.

    python benchmarks/bench_scaling.py --sglang-src /tmp/kvcore-ci-sglang-0.5.19/src --json --plot scaling.png
    python benchmarks/bench_scaling.py --max-len 131072 --max-leaves 30000     # quicker
    python benchmarks/bench_scaling.py --compare /old/tree .    # two checkouts, alternating sides
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = 16
# The timer: this process's CPU time by default (--clock cpu), which a busy shared machine disturbs far less
# than wall time (--clock wall); everything runs single-threaded.
CLOCK = [time.process_time]


def _tools_on_path() -> None:
    # Appended, not prepended: with --compare the kvcore under test comes from PYTHONPATH, not this checkout.
    if ROOT not in sys.path:
        sys.path.append(ROOT)


def prompt_ids(length: int) -> list[int]:
    return [1 + (i * 7919) % 50000 for i in range(length)]


# --------------------------------------------------------------------------- kvcore


def kvcore_prompt(backend: str, length: int, chunk: int) -> float:
    """Seconds for one prompt of ``length`` tokens through kvcore.Engine in ``chunk``-token chunks, then finish."""
    import kvcore
    from kvcore.testing import make_req

    cache = kvcore.create_cache(backend, size=length + 4 * chunk, page_size=PAGE, max_num_reqs=4,
                                max_context_len=length + PAGE)
    engine = kvcore.Engine(cache)
    req = make_req("p", prompt_ids(length))
    gc.collect()
    t = CLOCK[0]()
    assert engine.admit(req)
    # The README's loop, as an engine writes it: fill_ids is read once per chunk.
    while req.kv.kv_committed_len < len(req.fill_ids):
        assert engine.extend(req, req.kv.kv_committed_len + chunk)
    engine.finish(req)
    spent = CLOCK[0]() - t
    assert cache.total_size() == length // PAGE * PAGE, cache.total_size()
    return spent


def kvcore_evict(backend: str, leaves: int, calls: int, free_list: bool = True) -> tuple[float, list[int] | None]:
    """(seconds per evict(16) call, the free list after the run) on a tree of ``leaves`` one-page leaves.

    The free list is None with ``free_list`` False (no SGLang peer to compare it with) and for a
    windowed backend (its two-pool allocator has no single free list to compare with RadixCache's)."""
    import kvcore
    from kvcore.capabilities import windowed
    from tools.differential import our_free_pages

    cache = kvcore.create_cache(backend, size=(leaves + calls + 8) * PAGE, page_size=PAGE, max_num_reqs=4,
                                max_context_len=64)
    alloc = cache.token_to_kv_pool_allocator
    for i in range(leaves):
        cache.insert([i + 1] * PAGE, alloc.alloc(PAGE))
    gc.collect()
    spent = 0.0
    for j in range(calls):
        cache.insert([leaves + j + 1] * PAGE, alloc.alloc(PAGE))
        t = CLOCK[0]()
        cache.evict(PAGE)
        spent += CLOCK[0]() - t
    assert cache.total_size() == leaves * PAGE
    return spent / calls, our_free_pages(alloc) if free_list and windowed(cache) is None else None


# --------------------------------------------------------------------------- SGLang 0.5.19


def load_sglang(src: str | None) -> tuple[Any, str]:
    """(SGLang's classes as ``tools.sglang_loader.load_sglang`` gives them, how) or (None, why not)."""
    _tools_on_path()
    from tools.sglang_loader import default_src
    from tools.sglang_loader import load_sglang as load

    src = src or default_src()
    if src is None:
        return None, "no SGLang source (pass --sglang-src or set KVCORE_SGLANG_SRC)"
    try:
        return load(src), f"SGLang 0.5.19 RadixCache from {src} (tools/sglang_loader.py)"
    except Exception as exc:  # noqa: BLE001 - any failure to load means: run without the peer
        return None, f"could not load SGLang from {src}: {type(exc).__name__}: {exc}"


def sglang_prompt(sg: Any, length: int, chunk: int) -> float:
    """The same prompt through SGLang's own RadixCache, pools and ``cache_unfinished_req``, driven as
    its scheduler drives them (admission, a paged ``alloc_extend`` and row write per chunk, finish)."""
    alloc = sg.make_allocator(length + 4 * chunk, PAGE)
    rows = sg.make_req_to_token_pool(4, length + PAGE)
    cache = sg.RadixCache(sg.CacheInitParams(disable=False, req_to_token_pool=rows,
                                             token_to_kv_pool_allocator=alloc, page_size=PAGE))
    req = sg.SGReq("p", prompt_ids(length))
    kv = req.kv
    t64 = lambda v: torch.tensor([v], dtype=torch.int64)  # noqa: E731
    gc.collect()
    t = CLOCK[0]()
    # Admission (SGLang's init_next_round_input + PrefillAdder): match fill_ids[:-1], lock, a row.
    m = cache.match_prefix(sg.MatchPrefixParams(key=sg.RadixKey(req.origin_input_ids[: length - 1])))
    req.last_node = m.last_device_node
    cache.inc_lock_ref(req.last_node)
    assert rows.alloc([req]) is not None
    n_pre = int(m.device_indices.numel())
    rows.write((kv.req_pool_idx, slice(0, n_pre)), m.device_indices)
    kv.cache_protected_len = kv.kv_committed_len = kv.kv_allocated_len = n_pre
    while kv.kv_committed_len < length:
        pre = kv.kv_allocated_len
        end = min(pre + chunk, length)
        last = int(rows.req_to_token[kv.req_pool_idx, pre - 1]) if pre else -1
        slots = alloc.alloc_extend(t64(pre), t64(pre), t64(end), t64(end), t64(last), end - pre)
        assert slots is not None
        rows.write((kv.req_pool_idx, slice(pre, end)), slots.to(torch.int32))
        kv.kv_committed_len = kv.kv_allocated_len = end
        # Every chunk, the last one too (SGLang's scheduler caches a completed prompt).
        cache.cache_unfinished_req(req, chunked=end < length)
    cache.cache_finished_req(req, kv_len_to_handle=kv.kv_committed_len)
    rows.free(req)
    spent = CLOCK[0]() - t
    assert cache.total_size() == length // PAGE * PAGE, cache.total_size()
    return spent


def sglang_evict(sg: Any, leaves: int, calls: int) -> tuple[float, list[int]]:
    from tools.differential import sglang_free_pages

    alloc = sg.make_allocator((leaves + calls + 8) * PAGE, PAGE)
    cache = sg.RadixCache(sg.CacheInitParams(disable=False, req_to_token_pool=None,
                                             token_to_kv_pool_allocator=alloc, page_size=PAGE))
    Key, Insert, Evict = sg.RadixKey, sg.InsertParams, sg.EvictParams
    for i in range(leaves):
        cache.insert(Insert(key=Key([i + 1] * PAGE), value=alloc.alloc(PAGE)))
    gc.collect()
    spent = 0.0
    for j in range(calls):
        cache.insert(Insert(key=Key([leaves + j + 1] * PAGE), value=alloc.alloc(PAGE)))
        t = CLOCK[0]()
        cache.evict(Evict(num_tokens=PAGE))
        spent += CLOCK[0]() - t
    assert cache.total_size() == leaves * PAGE
    return spent / calls, sglang_free_pages(alloc, with_released=True)


# --------------------------------------------------------------------------- the run


def measure(args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    CLOCK[0] = time.process_time if args.clock == "cpu" else time.perf_counter
    _tools_on_path()
    backends = [b for b in args.backends.split(",") if b]
    sg, how = (None, "disabled (--no-sglang)") if args.no_sglang else load_sglang(args.sglang_src)
    if sg is None and not args.no_sglang:
        print(f"bench_scaling: SGLang peer skipped: {how}", file=sys.stderr)
    names = backends + (["sglang"] if sg is not None else [])
    lens = [n for n in args.prompt_lens if args.max_len is None or n <= args.max_len]
    sizes = [n for n in args.tree_sizes if args.max_leaves is None or n <= args.max_leaves]
    out: dict = {
        "config": {"chunk": args.chunk, "page_size": PAGE, "evict_calls": args.evict_calls, "repeat": args.repeat,
                   "policy": "lru", "clock": args.clock},
        "peers": {"sglang": how},
        "prompt_ns_per_token": {n: {} for n in names},
        "evict_ms_per_call": {n: {} for n in names},
        "same_victims": {},
    }

    def prompt_run(name: str, n: int) -> float:
        return sglang_prompt(sg, n, args.chunk) if name == "sglang" else kvcore_prompt(name, n, args.chunk)

    def evict_run(name: str, n: int) -> tuple[float, list[int] | None]:
        if name == "sglang":
            return sglang_evict(sg, n, args.evict_calls)
        return kvcore_evict(name, n, args.evict_calls, free_list=sg is not None)

    for name in names:  # warm-up, untimed: first imports and first-call caches
        prompt_run(name, 2 * args.chunk)
        if sizes:
            evict_run(name, 100)
    for n in lens:
        best = {name: float("inf") for name in names}
        for _ in range(_repeats(args.repeat, n, max(lens))):  # the caches alternate: noise hits all alike
            for name in names:
                best[name] = min(best[name], prompt_run(name, n))
        for name in names:
            out["prompt_ns_per_token"][name][str(n)] = best[name] / n * 1e9
        _progress(args, "prompt", n, {k: v / n * 1e9 for k, v in best.items()}, "ns/token")
    for n in sizes:
        best = {name: float("inf") for name in names}
        free: dict[str, list[int] | None] = {}
        for _ in range(_repeats(args.repeat, n, max(sizes))):
            for name in names:
                sec, free[name] = evict_run(name, n)
                best[name] = min(best[name], sec)
        for name in names:
            out["evict_ms_per_call"][name][str(n)] = best[name] * 1e3
        if "sglang" in free:
            out["same_victims"][str(n)] = {b: free[b] == free["sglang"] for b in backends if free[b] is not None}
        _progress(args, "evict", n, {k: v * 1e3 for k, v in best.items()}, "ms/call")
    out["growth"] = {what: {name: _growth(per) for name, per in out[what].items()}
                     for what in ("prompt_ns_per_token", "evict_ms_per_call")}
    # Speedups against SGLang from this one run: SGLang's time over the backend's (above 1: kvcore faster).
    out["speedup_vs_sglang"] = {
        what: {b: {size: out[what]["sglang"][size] / t for size, t in out[what][b].items()} for b in backends}
        for what in ("prompt_ns_per_token", "evict_ms_per_call")} if sg is not None else {}
    return out


def _repeats(repeat: int, size: int, largest: int) -> int:
    """``repeat`` runs, and more (up to 8) for the sizes far below the largest: their runs are short and noisy."""
    return max(repeat, min(8, largest // (4 * size)))


def _growth(per: dict[str, float]) -> float | None:
    """Largest size's figure over the smallest size's."""
    if len(per) < 2:
        return None
    keys = sorted(per, key=int)
    return per[keys[-1]] / per[keys[0]]


def _progress(args: argparse.Namespace, what: str, n: int, figures: dict[str, float], unit: str) -> None:
    if not args.quiet:
        print(f"bench_scaling: {what} {n}: " + ", ".join(f"{k} {v:.4g}" for k, v in figures.items()) + f" {unit}",
              file=sys.stderr, flush=True)


def print_table(result: dict) -> None:
    for what, unit in (("prompt_ns_per_token", "ns per prompt token"), ("evict_ms_per_call", "ms per evict(16)")):
        per = result[what]
        names = list(per)
        sizes = sorted({s for v in per.values() for s in v}, key=int)
        if not sizes:
            continue
        sp = result.get("speedup_vs_sglang", {}).get(what, {})
        head = f"{'size':>8} " + " ".join(f"{n:>10}" for n in names) + "".join(f" {b + '/sglang':>15}" for b in sp)
        print(f"{what} ({unit}; speedup = SGLang's time / the backend's)")
        print(head)
        for s in sizes:
            print(f"{s:>8} " + " ".join(f"{per[n].get(s, float('nan')):>10.4g}" for n in names)
                  + "".join(f" {sp[b][s]:>14.2f}x" for b in sp))
        print(f"{'growth':>8} " + " ".join(f"{(result['growth'][what][n] or 0):>9.2f}x" for n in names))
        if what == "evict_ms_per_call" and result.get("same_victims"):
            print("same victims as SGLang: " + ", ".join(f"{s}: {v}" for s, v in result["same_victims"].items()))
        print()


def plot(result: dict, path: str) -> None:
    """Two panels: ns per prompt token against prompt length, ms per evict call against tree size."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SystemExit(f"--plot needs matplotlib (pip install -e '.[plot]'): {exc}") from None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    panels = (("prompt_ns_per_token", "prompt length (tokens)", "ns per prompt token",
               f"chunked prefill ({result['config']['chunk']}-token chunks), then finish"),
              ("evict_ms_per_call", "tree size (one-page leaves)", "ms per evict(16) call",
               "evict(16), page 16, LRU"))
    for ax, (what, xlabel, ylabel, title) in zip(axes, panels):
        for name, per in result[what].items():
            xs = sorted(per, key=int)
            if xs:
                ax.plot([int(x) for x in xs], [per[x] for x in xs], marker="o",
                        label="SGLang 0.5.19 RadixCache" if name == "sglang" else f"kvcore {name}")
        ax.set_xscale("log", base=2 if what == "prompt_ns_per_token" else 10)
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _side(root: str, argv: list[str]) -> dict:
    paths = [root] + [os.path.join(root, d, p) for d in ("plugins",) for p in sorted(os.listdir(os.path.join(root, d)))]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
    res = subprocess.run([sys.executable, os.path.abspath(__file__), *argv, "--json", "--quiet"], env=env, cwd="/",
                         capture_output=True, text=True, check=True)
    return json.loads(res.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backends", default="radix,unified", help="comma-separated kvcore backends")
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[8192, 32768, 131072, 524288])
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--max-len", type=int, default=None, help="skip prompt lengths above this")
    ap.add_argument("--tree-sizes", type=int, nargs="+", default=[1000, 10000, 30000, 100000])
    ap.add_argument("--max-leaves", type=int, default=None, help="skip tree sizes above this")
    ap.add_argument("--evict-calls", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=2, help="runs per cache and size; the best is reported")
    ap.add_argument("--clock", choices=["cpu", "wall"], default="cpu",
                    help="cpu (default): this process's CPU time; wall: elapsed time")
    ap.add_argument("--sglang-src", default=None,
                    help="SGLang 0.5.19 source root (the folder holding sglang/); default $KVCORE_SGLANG_SRC")
    ap.add_argument("--no-sglang", action="store_true", help="no SGLang peer")
    ap.add_argument("--rounds", type=int, default=2, help="with --compare: rounds, each side once per round")
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    ap.add_argument("--plot", metavar="FILE.png", default=None, help="draw both measurements (matplotlib)")
    ap.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    args = ap.parse_args()
    if not args.compare:
        result = measure(args)
        if args.plot:
            plot(result, args.plot)
        if args.json:
            print(json.dumps(result, indent=2))
        else:
            print_table(result)
        return
    skip = {"--compare", *args.compare}
    argv, it = [], iter(sys.argv[1:])
    for a in it:
        if a == "--plot":
            next(it, None)
        elif a not in skip and not a.startswith("--plot="):
            argv.append(a)
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

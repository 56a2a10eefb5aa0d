#!/usr/bin/env python
"""How much KV memory does sliding-window attention save?  A long-decode workload.

Drives the ``swa`` backend through ``kvcore.engine.Engine`` (admit: match + lock +
row; prefill; batched decode with one slot per running request per step, then
one window free for the whole batch, ``cache.free_window_slots``; finish:
``kvcore.release_kv_cache``), and the same workload under ``radix`` (full
attention only) for comparison.  Requests arrive one per step (continuous
batching), so at most one request at a time holds a whole prompt in the window
pool.

Reports, per page size: the window pool's peak, the full pool's peak, radix's
peak, the ratio window/radix, and the expected bound
``R x (W + 2 pages) + tree-held`` (tree-held: window slots the tree holds at the
moment of the peak).  The window peak should be within a few percent of it.

    python benchmarks/bench_swa_memory.py                 # 64 x (256 + 4096), W=128, pages 1 and 16
    python benchmarks/bench_swa_memory.py --json
    python benchmarks/bench_swa_memory.py --requests 8 --decode 512 --page-sizes 1 --backends swa,swa-chunk,radix
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import asdict, dataclass

import kvcore
from kvcore import Req
from kvcore.engine import Engine
from kvcore.record import ceil_align


@dataclass
class RunResult:
    backend: str
    page_size: int
    requests: int
    prompt_len: int
    decode_len: int
    window: int | None
    full_pool: int
    swa_pool: int | None
    peak_full: int = 0
    peak_swa: int | None = None
    peak_step: int = 0
    tree_swa_at_peak: int | None = None
    bound_swa: int | None = None
    peak_over_bound: float | None = None
    evictions: int = 0
    free_swa_calls: int = 0
    steps: int = 0
    seconds: float = 0.0
    leak_check: str = "not run"


def _build(backend: str, args, page_size: int):
    r, pl, dl, w = args.requests, args.prompt, args.decode, args.window
    width = ceil_align(pl + dl + page_size, page_size)
    # The full side keeps every token of every request (full-attention layers need them).
    full = ceil_align(r * ceil_align(pl + dl + page_size, page_size) + 4 * page_size, page_size)
    opts = dict(size=full, page_size=page_size, max_num_reqs=r, max_context_len=width, device=args.device)
    swa_pool = None
    if backend != "radix":
        # Room for every running window, one prompt being prefilled and what the tree keeps.
        swa_pool = ceil_align(2 * r * (w + 2 * page_size) + pl + 4 * page_size, page_size)
        if args.swa_size:
            swa_pool = ceil_align(args.swa_size, page_size)
        opts.update(sliding_window_size=w, swa_size=swa_pool)
    return kvcore.create_cache(backend, **opts), full, swa_pool


def run(backend: str, page_size: int, args) -> RunResult:
    cache, full_pool, swa_pool = _build(backend, args, page_size)
    evictions = [0]

    def on_evict(_result) -> None:
        evictions[0] += 1

    # Prompts go into the tree at finish (not when prefill completes), so the window
    # pool holds only what the running requests hold: the quantity measured here.
    engine = Engine(cache, cache_prompt=False, release_idle_sessions=False, on_evict=on_evict)
    views = cache.pools()
    full_view = views[0]
    windowed = [v for v in views if v.windowed]
    window_view = windowed[0] if windowed else None
    is_swa = window_view is not None
    ps = page_size
    w = args.window
    res = RunResult(backend, ps, args.requests, args.prompt, args.decode, w if is_swa else None, full_pool, swa_pool)
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(args.vocab) for _ in range(args.prompt)] for _ in range(args.requests)]
    size_full = full_view.capacity
    size_swa = window_view.capacity if is_swa else None
    alloc = cache.token_to_kv_pool_allocator

    def tree_window_slots() -> int:
        if window_view is None:
            return 0
        return sum(cache.cached_sizes().get(window_view.name, (0, 0)))

    def admit(i: int) -> Req:
        req = Req(f"r{i}", prompts[i])
        # The whole prompt is the key; it is computed in one chunk.
        if not engine.admit(req, max_prefix_len=args.prompt):
            raise RuntimeError("out of req_to_token rows")
        # A chunk cache frees its window before each later prefill chunk (SGLang, done by
        # Engine.extend); a one-chunk prompt leaves the window free to the first decode step.
        if not engine.extend(req):
            raise RuntimeError(f"{backend}: cannot allocate the prompt of r{i}")
        return req

    running: list[Req] = []
    step = 0
    admitted = 0
    t0 = time.perf_counter()
    while admitted < args.requests or running:
        if admitted < args.requests:
            running.append(admit(admitted))
            admitted += 1
        # ---- one batched decode step: a slot for every running request (the window free comes after
        # the occupancy sample, so the peak counts the step's slots with nothing freed yet)
        tok = step % args.vocab
        if not engine.decode(running, [tok] * len(running), free_window=False):
            raise RuntimeError(f"{backend}: out of memory at decode step {step}")
        step += 1
        # ---- occupancy at its highest: the step's slots are allocated, nothing freed yet
        used_full = size_full - full_view.available()
        if used_full > res.peak_full:
            res.peak_full = used_full
        if is_swa:
            used_swa = size_swa - window_view.available()
            if res.peak_swa is None or used_swa > res.peak_swa:
                res.peak_swa, res.peak_step, res.tree_swa_at_peak = used_swa, step, tree_window_slots()
            # ---- the window moved: free what left it, one allocator free for the step (as SGLang's free group)
            res.free_swa_calls += len(running)
            if args.batch_free:
                engine.cache.free_window_slots(running)
            else:
                alloc.free_group_begin()
                for q in running:
                    engine.cache.free_window_slots([q])
                alloc.free_group_end()
        if args.check_every and step % args.check_every == 0:
            engine.check(running)
        # ---- finish
        done = [q for q in running if len(q.output_ids) >= args.decode]
        if done:
            for q in done:
                running.remove(q)
                engine.finish(q)
    res.seconds = time.perf_counter() - t0
    res.steps = step
    res.evictions = evictions[0]
    engine.check([])
    res.leak_check = "ok"
    if is_swa:
        res.bound_swa = args.requests * (w + 2 * ps) + (res.tree_swa_at_peak or 0)
        res.peak_over_bound = res.peak_swa / res.bound_swa
    return res


def _table(results: list[RunResult], radix_peaks: dict) -> str:
    head = (
        f"{'backend':<10} {'page':>4} {'W':>5} {'peak window':>12} {'peak full':>10} {'radix peak':>10} "
        f"{'window/radix':>12} {'bound':>8} {'peak/bound':>10} {'evict':>5} {'time s':>7}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        radix = radix_peaks.get(r.page_size)
        if r.peak_swa is None:
            lines.append(
                f"{r.backend:<10} {r.page_size:>4} {'-':>5} {'-':>12} {r.peak_full:>10} {r.peak_full:>10} "
                f"{'-':>12} {'-':>8} {'-':>10} {r.evictions:>5} {r.seconds:>7.2f}"
            )
            continue
        ratio = f"{r.peak_swa / radix:.4f}" if radix else "-"
        lines.append(
            f"{r.backend:<10} {r.page_size:>4} {r.window:>5} {r.peak_swa:>12} {r.peak_full:>10} "
            f"{radix if radix else '-':>10} {ratio:>12} {r.bound_swa:>8} {r.peak_over_bound:>10.4f} "
            f"{r.evictions:>5} {r.seconds:>7.2f}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=256, help="prompt tokens per request")
    ap.add_argument("--decode", type=int, default=4096, help="decode tokens per request")
    ap.add_argument("--window", type=int, default=128, help="sliding window W")
    ap.add_argument("--page-sizes", default="1,16")
    ap.add_argument("--backends", default="swa,radix", help="comma list of swa, swa-chunk, radix")
    ap.add_argument(
        "--swa-size", type=int, default=0, help="window-pool slots (default: 2 x R x (W + 2 pages) + a prompt)"
    )
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--check-every", type=int, default=0, help="run the invariant checker every N steps (0: at the end only)"
    )
    ap.add_argument(
        "--no-batch-free",
        dest="batch_free",
        action="store_false",
        help="give every request's window free to the allocator separately (slow: one validated call each)",
    )
    ap.add_argument("--json", action="store_true", help="print JSON instead of the table")
    args = ap.parse_args(argv)

    page_sizes = [int(p) for p in args.page_sizes.split(",") if p]
    backends = [b for b in args.backends.split(",") if b]
    results: list[RunResult] = []
    radix_peaks: dict[int, int] = {}
    for ps in page_sizes:
        for backend in backends:
            r = run(backend, ps, args)
            results.append(r)
            if backend == "radix":
                radix_peaks[ps] = r.peak_full
    out = {
        "workload": {
            "requests": args.requests,
            "prompt": args.prompt,
            "decode": args.decode,
            "window": args.window,
            "seed": args.seed,
        },
        "results": [asdict(r) for r in results],
        "radix_peak_full": radix_peaks,
    }
    for r in out["results"]:
        radix = radix_peaks.get(r["page_size"])
        r["window_over_radix"] = (r["peak_swa"] / radix) if (radix and r["peak_swa"] is not None) else None
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(
            f"SWA memory: {args.requests} requests x ({args.prompt} prompt + {args.decode} decode), "
            f"W={args.window}, one arrival per step"
        )
        print(_table(results, radix_peaks))
        print("bound = requests x (W + 2 pages) + window slots the tree holds at the peak")
    for r in results:
        if r.peak_over_bound is not None and r.peak_over_bound > 1.05:
            print(
                f"note: {r.backend} page {r.page_size}: the window peak is {100 * (r.peak_over_bound - 1):.1f}% over "
                f"the bound; with few requests the one prompt being prefilled ({args.prompt} tokens in the window "
                "until its first decode step) weighs more",
                file=sys.stderr,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Radix-tree bookkeeping cost: kvcore backends vs SGLang's RadixCache and SGLang 0.5.23's Rust tree core.

Trace: ``--requests`` requests of ``--req-len`` tokens, each starting with one of
``--num-prompts`` shared ``--prompt-len``-token system prompts (seeded RNG), the
rest random.  Each request does ``match_prefix`` and then ``insert`` of its whole
key (with a slot tensor as value, as an engine does).  Every cache runs the same
trace in the same process, interleaved, best of ``--repeat``; the matched lengths
must agree exactly.  Figures are ns per token of this process's CPU time
(``--clock wall`` for elapsed time) and ratios from this one run.

    python benchmarks/bench_radix.py --sglang-src /tmp/sgl/src --page-sizes 1 16
    python benchmarks/bench_radix.py --key-mode array --rust-core fetch
    python benchmarks/bench_radix.py --backends radix,unified --backend-opt unified:components='["full"]'
    python benchmarks/bench_radix.py --json

Keys (``--key-mode``): ``fresh`` (default) builds a new key from a new list for
every call, as an engine that makes ``RadixKey(fill_ids[:n])`` per call does;
``reused`` passes one key object to both calls of a request; ``array`` gives
every side ``array("q")`` keys (SGLang's own container), a new one per call.

kvcore backends (``--backends``, default ``radix``) are built by name with
``kvcore.create_cache`` on real pools: every request's slots are allocated
before the clock starts.  ``--backend-opt [name:]key=value`` passes an option
(to one backend, or all); a backend that is not installed is skipped with a
note on stderr.  ``swa`` gets a window of 128 and a window pool as large as the
full one unless told otherwise; its insert frees the duplicates itself.

Peers.  SGLang's ``RadixCache`` is imported from ``--sglang-src`` when given;
modules it needs that are missing here (metrics, kernels, KV-event transport)
are replaced by stubs from ``tools/sglang_loader.py``; the radix tree code itself
is SGLang's own (simulated mode: fake slot values).  The Rust tree core is the
compiled extension from SGLang 0.5.23's wheel (``tools/sglang_rust_shim.py``:
``--rust-core fetch`` runs ``pip download --no-deps sglang==0.5.23`` into the
cache folder, ``--rust-core PATH.whl`` takes a wheel at hand), driven through
its binding as ``UnifiedRadixCache(tree_core="rust")`` drives it but without
that class's Python layer; it reports the matched length (no slot tensor) and
needs ``array("q")`` keys, so with list keys the caller converts them.  A peer
that cannot be loaded is skipped with a note on stderr.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import random
import sys
import time
from array import array

import torch

# --------------------------------------------------------------------------- trace


def make_trace(seed: int, requests: int, req_len: int, num_prompts: int, prompt_len: int, vocab: int):
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(num_prompts)]
    trace = []
    for _ in range(requests):
        p = prompts[rng.randrange(num_prompts)]
        trace.append(p + [rng.randrange(vocab) for _ in range(req_len - prompt_len)])
    return trace


def make_values(trace, req_len: int):
    # Fake slot ids (distinct per request); neither cache frees anything in this trace.
    return [torch.arange(1 + i * req_len, 1 + (i + 1) * req_len, dtype=torch.int64) for i in range(len(trace))]


# --------------------------------------------------------------------------- keys

KEY_MODES = ("fresh", "reused", "array")
# The timer: this process's CPU time by default (--clock cpu), which a busy shared machine disturbs
# far less than wall time (--clock wall); every cache runs single-threaded.
CLOCK = [time.process_time]


def key_source(trace, key_mode: str):
    """The per-request token containers a run's keys are built from (made before the clock starts)."""
    return [array("q", ids) for ids in trace] if key_mode == "array" else trace


def timed_loop(match, insert, make_key, sources, values, key_mode: str):
    """Time ``match(key)`` + ``insert(key, value)`` per request; returns (seconds, matched lengths).

    ``fresh`` and ``array``: each call gets a key of its own, built from a fresh
    copy of the request's ids (a list slice, or an ``array("q")`` slice), as an
    engine that builds ``RadixKey(fill_ids[:n])`` per call does.  ``reused``:
    one key object per request for both calls.  ``match`` returns the matched
    length.
    """
    matched = [0] * len(sources)
    clock = CLOCK[0]
    gc.collect()
    t0 = clock()
    if key_mode == "reused":
        for i, ids in enumerate(sources):
            key = make_key(ids)
            matched[i] = match(key)
            insert(key, values[i])
    else:
        for i, ids in enumerate(sources):
            matched[i] = match(make_key(ids[:]))
            insert(make_key(ids[:]), values[i])
    return clock() - t0, matched


# --------------------------------------------------------------------------- ours

# Options a backend needs on this trace unless --backend-opt says otherwise ("{size}": the pool size).
BACKEND_DEFAULTS: dict[str, dict] = {"swa": {"swa_size": "{size}", "sliding_window_size": 128}}


def parse_backend_opts(items: list[str], backends: list[str]) -> dict[str, dict]:
    """``[backend:]key=value`` (value read as JSON when it parses, else a string) -> per-backend options."""
    opts: dict[str, dict] = {b: {} for b in backends}
    for item in items:
        target, sep, rest = item.partition(":")
        if not sep or "=" in target:
            target, rest = "", item
        key, eq, raw = rest.partition("=")
        if not eq or not key:
            raise SystemExit(f"--backend-opt {item!r}: expected [backend:]key=value")
        try:
            value = json.loads(raw)
        except ValueError:
            value = raw
        for b in backends if not target else [target]:
            if b not in opts:
                raise SystemExit(f"--backend-opt {item!r}: {b!r} is not in --backends")
            opts[b][key] = value
    return opts


def run_kvcore(backend: str, options: dict, trace, sources, page_size: int, policy: str, key_mode: str):
    """A kvcore backend built by name (``kvcore.create_cache``) on real pools: every request's
    slots are allocated before the clock starts; each request matches and inserts."""
    import kvcore

    req_len = len(trace[0])
    size = -(-(len(trace) * req_len + page_size) // page_size) * page_size
    opts = {k: (size if v == "{size}" else v) for k, v in BACKEND_DEFAULTS.get(backend, {}).items()}
    opts.update(size=size, page_size=page_size, max_num_reqs=1,
                max_context_len=-(-req_len // page_size) * page_size, eviction_policy=policy)
    opts.update(options)
    cache = kvcore.create_cache(backend, **opts)
    alloc = cache.token_to_kv_pool_allocator.alloc
    need = -(-req_len // page_size) * page_size
    # Real slots from the pool (strict inserts refuse slots it never handed out).
    slots = [alloc(need)[: len(ids)] for ids in trace]
    RadixKey = kvcore.RadixKey
    match = cache.match_prefix

    def match_len(key):
        return match(key).device_indices.shape[0]

    elapsed, matched = timed_loop(match_len, cache.insert, RadixKey, sources, slots, key_mode)
    return elapsed, matched, cache.total_size()


# --------------------------------------------------------------------------- SGLang


def _stub_sglang(src: str) -> None:
    """Make ``sglang.srt.mem_cache.radix_cache`` importable without SGLang's heavy deps."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tools.sglang_loader import load_sglang

    load_sglang(src)


def import_sglang(src: str | None):
    """(module, how) or (None, why)."""
    if src is None:
        try:
            return importlib.import_module("sglang.srt.mem_cache.radix_cache"), "installed sglang"
        except Exception as exc:  # noqa: BLE001
            return None, f"sglang not importable ({type(exc).__name__}: {exc}); pass --sglang-src"
    if src not in sys.path:
        sys.path.insert(0, src)
    try:
        return importlib.import_module("sglang.srt.mem_cache.radix_cache"), f"{src} (as is)"
    except Exception:  # noqa: BLE001 - fall back to stubs
        pass
    try:
        _stub_sglang(src)
        return importlib.import_module("sglang.srt.mem_cache.radix_cache"), f"{src} (missing deps stubbed)"
    except Exception as exc:  # noqa: BLE001
        return None, f"could not import SGLang from {src}: {type(exc).__name__}: {exc}"


def run_sglang(mod, trace, sources, values, page_size: int, policy: str, key_mode: str):
    """SGLang's own ``RadixCache`` (simulated: fake slot values, nothing freed in this trace)."""
    bpc = sys.modules["sglang.srt.mem_cache.base_prefix_cache"]
    MatchPrefixParams, InsertParams = bpc.MatchPrefixParams, bpc.InsertParams
    cache = mod.RadixCache.create_simulated(page_size=page_size)
    if policy != "lru":
        cache.eviction_strategy = sys.modules["sglang.srt.mem_cache.utils"].get_eviction_strategy(policy)
    match, insert = cache.match_prefix, cache.insert

    def match_len(key):
        return match(MatchPrefixParams(key=key)).device_indices.shape[0]

    def insert_kv(key, value):
        insert(InsertParams(key=key, value=value))

    elapsed, matched = timed_loop(match_len, insert_kv, mod.RadixKey, sources, values, key_mode)
    return elapsed, matched, cache.total_size()


def run_rust(mod, trace, sources, values, page_size: int, policy: str, key_mode: str):
    """SGLang 0.5.23's Rust tree core, driven through its binding as ``UnifiedRadixCache`` drives it
    (``match_prefix``; ``begin_insert`` / ``resume_insert`` / ``end_insert``), without that class's
    Python layer: the fastest the core runs.  Keys must be ``array("q")``: list ids are converted by
    the caller (per call, or once per request with ``reused``)."""
    core = mod.RustUnifiedTreeCoreBinding(
        mod.TreeCoreInitParamsBinding(eviction_policy=policy, page_size=page_size, device="cpu"), [0])
    MatchParams, InsertParams = mod.MatchParamsBinding, mod.InsertParamsBinding
    match, begin, resume, end = core.match_prefix, core.begin_insert, core.resume_insert, core.end_insert

    def match_len(key):
        return match(MatchParams(key=key)).device_prefix_len

    def insert_kv(key, value):
        step = begin(InsertParams(key=key, value=value))
        while step.result is None:
            step = resume()
        end()

    # array("q", ids) takes a list (a copy) or an array (a slice is already a fresh array).
    make_key = (lambda ids: ids) if key_mode == "array" else (lambda ids: array("q", ids))
    elapsed, matched = timed_loop(match_len, insert_kv, make_key, sources, values, key_mode)
    total = core.total_size()  # (full-pool tokens, other components')
    return elapsed, matched, total[0] if isinstance(total, (tuple, list)) else total


# --------------------------------------------------------------------------- main


def _best(best, r):
    return r if best is None or r[0] < best[0] else best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", default=None,
                    help="comma-separated kvcore backends to time (default: radix); one not installed is skipped")
    ap.add_argument("--backend", default=None, help=argparse.SUPPRESS)  # old spelling of --backends
    ap.add_argument("--backend-opt", action="append", default=[], metavar="[BACKEND:]KEY=VALUE",
                    help="an option for kvcore.create_cache (all backends, or one); VALUE is read as JSON if it "
                         "parses (e.g. --backend-opt unified:components='[\"full\"]')")
    ap.add_argument("--key-mode", choices=KEY_MODES, default="fresh",
                    help="fresh (default): a new list key per call; reused: one key per request for match and "
                         "insert; array: array('q') keys on every side")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--req-len", type=int, default=512)
    ap.add_argument("--num-prompts", type=int, default=10)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--page-sizes", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--policy", default="lru")
    ap.add_argument("--repeat", type=int, default=5, help="runs per cache; the best is reported")
    ap.add_argument("--sglang-src", default=None, help="SGLang source root (the folder holding sglang/)")
    ap.add_argument("--no-sglang", action="store_true", help="no SGLang RadixCache peer")
    ap.add_argument("--rust-core", default="auto", metavar="auto|fetch|off|PATH.whl",
                    help="SGLang 0.5.23's Rust tree core as a peer: auto (default) uses a wheel or extension "
                         "already in the cache folder ($KVCORE_BENCH_CACHE or ~/.cache/kvcore-bench), fetch "
                         "also runs `pip download --no-deps sglang==0.5.23` into it, PATH.whl takes that wheel; "
                         "skipped with a note when it cannot be loaded")
    ap.add_argument("--key-validation", choices=["full", "stored"], default="full",
                    help="kvcore-radix key checking: full (default) or stored (match skips the unmatched tail)")
    ap.add_argument("--no-strict", action="store_true",
                    help="build the kvcore caches with strict=False (no slot ownership checks on insert)")
    ap.add_argument("--clock", choices=["cpu", "wall"], default="cpu",
                    help="cpu (default): this process's CPU time; wall: elapsed time")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    CLOCK[0] = time.process_time if args.clock == "cpu" else time.perf_counter

    backends = [b for b in (args.backends or args.backend or "radix").split(",") if b]
    options = parse_backend_opts(args.backend_opt, backends)
    import kvcore

    known = kvcore.available_backends()
    for b in list(backends):
        if b not in known:
            print(f"bench_radix: backend {b!r} is not installed (known: {', '.join(sorted(known))}); skipped",
                  file=sys.stderr)
            backends.remove(b)
            continue
        if args.no_strict:
            options[b].setdefault("strict", False)
        if args.key_validation != "full" and b == "radix":
            options[b].setdefault("key_validation", args.key_validation)
    if not backends:
        print("bench_radix: no kvcore backend to run", file=sys.stderr)
        return 2

    trace = make_trace(args.seed, args.requests, args.req_len, args.num_prompts, args.prompt_len, args.vocab)
    values = make_values(trace, args.req_len)
    sources = key_source(trace, args.key_mode)
    tokens = args.requests * args.req_len

    sgl, how = (None, "disabled") if args.no_sglang else import_sglang(args.sglang_src)
    if sgl is None and not args.no_sglang:
        print(f"bench_radix: SGLang RadixCache peer skipped: {how}", file=sys.stderr)
    rust, rust_how = None, "off"
    if args.rust_core != "off":
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from tools.sglang_rust_shim import load_rust_tree_core

        wheel = None if args.rust_core in ("auto", "fetch") else args.rust_core
        rust, rust_how = load_rust_tree_core(wheel=wheel, fetch=args.rust_core == "fetch")
        if rust is None:
            print(f"bench_radix: Rust tree core peer skipped: {rust_how}", file=sys.stderr)

    peers = []
    if sgl is not None:
        peers.append(("sglang", lambda ps: run_sglang(sgl, trace, sources, values, ps, args.policy, args.key_mode)))
    if rust is not None:
        peers.append(("rust", lambda ps: run_rust(rust, trace, sources, values, ps, args.policy, args.key_mode)))
    runs = [(b, (lambda ps, b=b: run_kvcore(b, options[b], trace, sources, ps, args.policy, args.key_mode)))
            for b in backends] + peers

    rows = []
    ok = True
    for ps in args.page_sizes:
        # Interleave every cache and keep each one's best run: this box is shared and noisy.
        best: dict = {name: None for name, _ in runs}
        for _ in range(args.repeat):
            for name, fn in runs:
                try:
                    best[name] = _best(best[name], fn(ps))
                except kvcore.KvcoreError as exc:  # a bad --backend-opt: say which, no traceback
                    print(f"bench_radix: {name}: {exc}", file=sys.stderr)
                    return 2
        ref = best[backends[0]]
        row: dict = {"page_size": ps}
        for name, _ in runs:
            r = best[name]
            row[name] = {"req_per_s": args.requests / r[0], "ns_per_token": r[0] * 1e9 / tokens,
                         "matched_tokens": sum(r[1]), "cached_tokens": r[2],
                         "same_match": r[1] == ref[1] and r[2] == ref[2]}
            ok &= row[name]["same_match"]
        # Every ratio: a peer's time over a kvcore backend's, from this one run.
        row["speedup"] = {f"{b}/{p}": best[p][0] / best[b][0] for b in backends for p, _ in peers}
        rows.append(row)

    result = {
        "backends": backends,
        "backend_options": options,
        "key_mode": args.key_mode,
        "trace": {k: getattr(args, k) for k in ("requests", "req_len", "num_prompts", "prompt_len", "vocab", "seed",
                                                "policy", "key_validation", "no_strict", "repeat", "clock")},
        "peers": {"sglang": how, "rust": rust_how},
        "rows": rows,
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"key mode {args.key_mode}; trace: {args.requests} requests x {args.req_len} tokens, "
              f"{args.num_prompts} shared {args.prompt_len}-token prompts, seed {args.seed}, policy {args.policy}, "
              f"strict {not args.no_strict}, best of {args.repeat}, {args.clock} time")
        print(f"  sglang: {how}\n  rust:   {rust_how}")
        names = [name for name, _ in runs]
        print(f"{'page':>5} " + " ".join(f"{n + ' ns/tok':>18}" for n in names)
              + "".join(f" {k:>14}" for k in rows[0]["speedup"]) + f" {'same match':>10}")
        for r in rows:
            same = all(r[n]["same_match"] for n in names)
            print(f"{r['page_size']:>5} " + " ".join(f"{r[n]['ns_per_token']:>18.1f}" for n in names)
                  + "".join(f" {v:>13.2f}x" for v in r["speedup"].values()) + f" {str(same):>10}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

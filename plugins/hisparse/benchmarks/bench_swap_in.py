"""HiSparse host-to-device bandwidth: the swap-in path against plain copies of the same bytes.

    python plugins/hisparse/benchmarks/bench_swap_in.py [--device cuda] [--repeats 7] [--json]

One long request is prefilled (its K/V written by the bench's K/V writer), staged to the
host (a side stream and events on CUDA), collected and decoded one step; then each sample
swaps in two alternating top-k selections that share no token, so every selected token is
a buffer miss copied from the host.  Four sides, timed in the same run, alternating their
order every repeat, each sample between two device synchronizations:

* ``swap_in``: ``HiSparseCoordinator.swap_in_selected_pages`` for one layer (the LRU
  bookkeeping and the copy: what a decode step pays per layer);
* ``load``: ``HiSparseHostPool.load_to_device_per_layer`` of the same slots (the copy alone);
* ``h2d_pinned``: ``copy_`` of one contiguous pinned host buffer of the same byte count to
  the device (what torch reaches for a plain host-to-device copy);
* ``h2d_pageable``: the same from pageable host memory.

Every swap-in is checked byte for byte against the host copy of the tokens it selected.
Figures are bytes per second (K and V of one layer); ratios are medians of per-repeat ratios.
On the CPU every side is a host-to-host copy: the code paths run, the figures say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable

import torch

import kvcore
from kvcore import Engine, Req
from kvcore.bench.kvwriter import KVWriter
from kvcore.devices import check_device, synchronize
from kvcore.errors import DeviceUnavailable

SIDES = ("swap_in", "load", "h2d_pinned", "h2d_pageable")


def _timed(fn: Callable[[], None], dev: torch.device, iters: int) -> float:
    synchronize(dev)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    synchronize(dev)
    return (time.perf_counter() - t0) / iters


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--top-k", type=int, default=None,
                    help="tokens per selection (default: 2048 on a GPU, 512 on the CPU)")
    ap.add_argument("--heads", type=int, default=None, help="K/V heads (default: 8 on a GPU, 2 on the CPU)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--iters", type=int, default=8,
                    help="calls per timed sample (an even number alternates the two selections)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    try:
        dev = check_device(args.device)
    except DeviceUnavailable as exc:
        print(f"bench_swap_in: {exc}", file=sys.stderr)
        return 1
    gpu = dev.type != "cpu"
    top_k = args.top_k or (2048 if gpu else 512)
    heads = args.heads or (8 if gpu else 2)
    if min(top_k, heads, args.head_dim, args.layers, args.repeats, args.iters) <= 0:
        print("bench_swap_in: --top-k, --heads, --head-dim, --layers, --repeats and --iters must be positive",
              file=sys.stderr)
        return 1
    length = 4 * top_k  # two disjoint selections and room to spare
    cache = kvcore.create_cache(
        "hisparse", size=2 * length, page_size=1, max_num_reqs=2, max_context_len=length + 8, device=str(dev),
        device_buffer_size=top_k, top_k=top_k, host_to_device_ratio=2,
        kv_buffer={"num_layers": args.layers, "num_heads": heads, "head_dim": args.head_dim, "dtype": "float16"},
    )
    writer = KVWriter(cache.kv_pool, dev, rows=length)
    eng = Engine(cache, kv_writer=writer)
    req = Req("long", list(range(1, length + 1)))
    assert eng.admit(req) and eng.extend(req)
    coord = cache.coordinator
    staged_on_side_stream = coord.ack_staging_queue[0].finish_event is not None
    eng.kv_writer = None
    assert eng.decode([req]) == 1
    eng.kv_writer = writer
    seq_len = req.kv.kv_allocated_len
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(length, generator=g)  # tokens [0, length) all have a host copy after staging
    sels = [perm[:top_k].view(1, -1), perm[top_k:2 * top_k].view(1, -1)]
    cache.on_decode_step([req], sels[0])  # collect, map the new token, first swap-in
    rows = torch.tensor([req.kv.req_pool_idx])
    lens = torch.tensor([seq_len])
    state = coord.state_of(req.kv)
    host = cache.host_pool
    layer = 0

    def check(sel: torch.Tensor, locs: torch.Tensor) -> None:
        want = host.k_buffer[layer][state.host_locs[sel[0]]]
        got = cache.kv_pool.k_buffer[layer][locs[0].to(torch.int64)].cpu()
        if not torch.equal(got, want):
            raise AssertionError("swap-in: device K differs from the host copy of the selected tokens")

    turn = [0]

    def swap_in() -> None:
        turn[0] ^= 1
        coord.swap_in_selected_pages(rows, lens, sels[turn[0]], layer)

    host_src = state.host_locs[sels[0][0]]
    dev_dst = state.device_buffer[:top_k]

    def load() -> None:
        host.load_to_device_per_layer(cache.kv_pool, host_src, dev_dst, layer)

    nbytes = top_k * cache.kv_pool.bytes_per_token_layer
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=gpu).random_(0, 255)
    pageable = torch.empty(nbytes, dtype=torch.uint8).random_(0, 255)

    def h2d_pinned() -> None:
        dst.copy_(pinned, non_blocking=True)

    def h2d_pageable() -> None:
        dst.copy_(pageable)

    fns = {"swap_in": swap_in, "load": load, "h2d_pinned": h2d_pinned, "h2d_pageable": h2d_pageable}
    for fn in fns.values():
        fn()
    samples: dict[str, list[float]] = {s: [] for s in SIDES}
    misses_before, bytes_before = coord.buffer_misses, coord.bytes_h2d
    swap_calls = 0
    for r in range(args.repeats):
        order = SIDES[r % 4:] + SIDES[:r % 4]
        for name in order:
            samples[name].append(nbytes / _timed(fns[name], dev, args.iters))
            swap_calls += args.iters if name == "swap_in" else 0
    all_misses = coord.buffer_misses - misses_before == swap_calls * top_k
    swap_bytes = coord.bytes_h2d - bytes_before
    for _ in sels:  # byte for byte, after the timing: each selection once more
        turn[0] ^= 1
        check(sels[turn[0]], coord.swap_in_selected_pages(rows, lens, sels[turn[0]], layer))
    med = {s: statistics.median(v) for s, v in samples.items()}
    ratios = {
        f"swap_in/{o}": statistics.median(a / b for a, b in zip(samples["swap_in"], samples[o]))
        for o in ("load", "h2d_pinned", "h2d_pageable")
    }
    ratios["load/h2d_pinned"] = statistics.median(a / b for a, b in zip(samples["load"], samples["h2d_pinned"]))
    result = {
        "benchmark": "bench_swap_in",
        "command": "python plugins/hisparse/benchmarks/bench_swap_in.py "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "device": str(dev),
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (host to host)",
        "torch": torch.__version__,
        "top_k": top_k, "heads": heads, "head_dim": args.head_dim, "layers": args.layers,
        "bytes_per_call": nbytes,
        "staged_on_side_stream": staged_on_side_stream,
        "host_pool_pinned": bool(host.k_buffer[0].is_pinned()) if gpu else False,
        "every_swap_in_was_all_misses": all_misses,
        "swap_in_bytes_counted": swap_bytes,
        "bytes_per_s_median": med,
        "bytes_per_s_samples": samples,
        "ratio_median": ratios,
    }
    eng.finish(req)
    kvcore.InvariantChecker(cache).check([])
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"HiSparse swap-in on {result['device']} ({result['device_name']}), top_k {top_k}, "
          f"{nbytes / 1e6:.1f} MB per layer call, median of {args.repeats} alternating repeats")
    print("| side | GB/s |")
    print("|---|---:|")
    for s in SIDES:
        print(f"| {s} | {med[s] / 1e9:.2f} |")
    print("ratios: " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

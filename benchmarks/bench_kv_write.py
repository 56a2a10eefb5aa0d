"""K/V write bandwidth: what the bench's K/V writer moves into MHATokenToKVPool, against plain copies.

    python benchmarks/bench_kv_write.py [--device cpu|cuda] [--repeats 7] [--json]

Three sides, timed in the same run, alternating their order every repeat, each sample
between two device synchronizations:

* ``writer``: :class:`kvcore.bench.kvwriter.KVWriter` called with one batch of slots
  (``set_kv_buffer`` per layer into the cache's :class:`kvcore.pools.MHATokenToKVPool`);
* ``index_copy``: ``index_copy_`` of the same source rows into the same pool buffers at the
  same slots (the plain scatter the writer should be close to; goal: at least half);
* ``copy``: ``copy_`` of one contiguous buffer of the same byte count on the device (the
  device-to-device bandwidth torch reaches for a plain copy; it reads as many bytes as it writes).

Two batch shapes, as the bench's serving loop hands them to the writer: ``prefill`` (one
``--chunk``-token chunk) and ``decode`` (``--batch`` single tokens at scattered slots).
Figures are bytes written per second (K and V, every layer); ratios are medians of the
per-repeat ratios.  On the CPU, ``copy`` is host memory bandwidth.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch

from kvcore.bench.kvwriter import KVWriter
from kvcore.devices import check_device, synchronize
from kvcore.errors import DeviceUnavailable
from kvcore.pools import MHATokenToKVPool

SIDES = ("writer", "index_copy", "copy")


def _timed(fn: Callable[[], None], dev: torch.device, iters: int) -> float:
    synchronize(dev)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    synchronize(dev)
    return (time.perf_counter() - t0) / iters


def _iters_for(fn: Callable[[], None], dev: torch.device, target_s: float) -> int:
    """Calls per sample so that one sample lasts about ``target_s``: after a warm-up call, the slowest
    of three timed calls decides (a noisy machine then gives shorter samples, never runaway ones)."""
    fn()
    once = max(_timed(fn, dev, 1) for _ in range(3))
    return max(1, min(10_000, int(target_s / max(once, 1e-7))))


def measure_shape(pool: MHATokenToKVPool, dev: torch.device, slots: torch.Tensor, repeats: int,
                  target_s: float) -> dict:
    n = int(slots.numel())
    writer = KVWriter(pool, dev, rows=n)
    src = writer.src[:n]
    layers = pool.layer_num

    def write() -> None:
        writer(slots)

    def index_copy() -> None:
        for layer in range(layers):
            pool.k_buffer[layer].index_copy_(0, slots, src)
            pool.v_buffer[layer].index_copy_(0, slots, src)

    nbytes = n * writer.token_bytes
    flat_src = torch.empty(nbytes, dtype=torch.uint8, device=dev).random_(0, 255)
    flat_dst = torch.empty_like(flat_src)

    def copy() -> None:
        flat_dst.copy_(flat_src)

    fns = {"writer": write, "index_copy": index_copy, "copy": copy}
    iters = {name: _iters_for(fn, dev, target_s) for name, fn in fns.items()}
    samples: dict[str, list[float]] = {name: [] for name in SIDES}
    for r in range(repeats):
        order = SIDES[r % 3:] + SIDES[:r % 3]  # alternate which side goes first
        for name in order:
            samples[name].append(nbytes / _timed(fns[name], dev, iters[name]))
    # The writer's bytes land where index_copy_ puts them: the same rows at the same slots.
    writer(slots)
    for layer in range(layers):
        if not (torch.equal(pool.k_buffer[layer][slots], src) and torch.equal(pool.v_buffer[layer][slots], src)):
            raise AssertionError(f"layer {layer}: the writer's K/V differ from the source rows")
    med = {name: statistics.median(v) for name, v in samples.items()}
    ratio = {
        f"writer/{other}": statistics.median(w / o for w, o in zip(samples["writer"], samples[other]))
        for other in ("index_copy", "copy")
    }
    return {
        "tokens": n,
        "bytes_per_call": nbytes,
        "iters_per_sample": iters,
        "bytes_per_s_median": med,
        "bytes_per_s_samples": samples,
        "ratio_median": ratio,
        "writer_at_least_half_of_index_copy": ratio["writer/index_copy"] >= 0.5,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: cpu)")
    ap.add_argument("--size", type=int, default=None,
                    help="pool slots (default: 65536 on a GPU, the bench's --size; 8192 on the CPU)")
    ap.add_argument("--chunk", type=int, default=2048, help="prefill tokens per call (the bench's chunk_size)")
    ap.add_argument("--batch", type=int, default=128, help="decode tokens per call (the bench's max_num_reqs)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--sample-s", type=float, default=0.05, help="seconds one timed sample aims for")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (default: torch's; 1 gives steadier CPU figures on a shared machine)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = ap.parse_args(argv)
    if args.threads is not None:
        if args.threads <= 0:
            print("bench_kv_write: --threads must be positive", file=sys.stderr)
            return 1
        torch.set_num_threads(args.threads)
    try:
        dev = check_device(args.device)
    except DeviceUnavailable as exc:  # one line naming what is missing
        print(f"bench_kv_write: {exc}", file=sys.stderr)
        return 1
    size = args.size if args.size is not None else (8192 if dev.type == "cpu" else 65536)
    for name in ("size", "chunk", "batch", "layers", "heads", "head_dim", "repeats"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            print(f"bench_kv_write: --{name.replace('_', '-')} must be positive", file=sys.stderr)
            return 1
    if max(args.chunk, args.batch) > size:
        print(f"bench_kv_write: --chunk and --batch must fit in --size {size}", file=sys.stderr)
        return 1
    pool = MHATokenToKVPool(size, 1, torch.float16, args.heads, args.head_dim, args.layers, dev)
    g = torch.Generator(device="cpu").manual_seed(args.seed)
    perm = torch.randperm(size, generator=g) + 1  # slot 0 is padding
    shapes = {
        "prefill": perm[: args.chunk].sort().values,  # a chunk's slots: ascending, as a fresh allocator hands them
        "decode": perm[: args.batch],  # one token per running request: scattered
    }
    result = {
        "benchmark": "bench_kv_write",
        "command": "python benchmarks/bench_kv_write.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "device": str(dev),
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "cpu_threads": torch.get_num_threads(),
        "pool": {"size": size, "layers": args.layers, "heads": args.heads, "head_dim": args.head_dim,
                 "dtype": "float16"},
        "repeats": args.repeats,
        "shapes": {
            name: measure_shape(pool, dev, slots.to(dev), args.repeats, args.sample_s)
            for name, slots in shapes.items()
        },
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"K/V write bandwidth on {result['device']} ({result['device_name']}), torch {result['torch']}, "
          f"median of {args.repeats} alternating repeats")
    print("| shape | tokens | MB/call | writer GB/s | index_copy_ GB/s | copy_ GB/s "
          "| writer/index_copy_ | writer/copy_ |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, s in result["shapes"].items():
        m, r = s["bytes_per_s_median"], s["ratio_median"]
        print(f"| {name} | {s['tokens']} | {s['bytes_per_call'] / 1e6:.1f} | {m['writer'] / 1e9:.2f} | "
              f"{m['index_copy'] / 1e9:.2f} | {m['copy'] / 1e9:.2f} | {r['writer/index_copy']:.2f} | "
              f"{r['writer/copy']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

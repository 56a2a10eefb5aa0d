"""Buffer hit rate and bytes moved vs --topk-locality and device_buffer_size on the sparse-decode workload.

    python plugins/hisparse/benchmarks/sweep.py [--num-requests 8] [--plot sweep.png]

Prints a Markdown table (one row per run); every run must end with 0 leaks and 0 violations.
"""

from __future__ import annotations

import argparse

import kvcore.bench.loop as loop
from kvcore.bench import run_bench


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-requests", type=int, default=8)
    ap.add_argument("--localities", default="0,0.25,0.5,0.75,0.9,1")
    ap.add_argument("--buffers", default="2048,4096,8192")
    ap.add_argument("--top-k", type=int, default=2048)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args()
    base_options = loop.cache_options
    rows = []
    print("| device_buffer_size | locality | hit rate | swap-in tokens | GB host->device | MB device->host "
          "| device peak / bound (slots) | device KV saved (MB) | leaks | violations |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for dbs in [int(x) for x in args.buffers.split(",")]:
        for loc in [float(x) for x in args.localities.split(",")]:
            def opts(cfg, max_len, _dbs=dbs):
                return base_options(cfg, max_len) | {"device_buffer_size": _dbs, "top_k": args.top_k}

            loop.cache_options = opts
            try:
                (r,) = run_bench(["hisparse"], workload="sparse-decode", num_requests=args.num_requests,
                                 topk_locality=loc, check_every=25)
            finally:
                loop.cache_options = base_options
            s = r["backend_stats"]
            hit = s["buffer_hits"] / max(1, s["buffer_hits"] + s["buffer_misses"])
            bound = s["decode_batch_peak"] * s["padded_buffer_size"]
            rows.append((dbs, loc, hit, s["bytes_h2d"]))
            print(f"| {dbs} | {loc:g} | {hit:.1%} | {s['swap_in_tokens']:,} | {s['bytes_h2d'] / 1e9:.2f} "
                  f"| {s['bytes_d2h'] / 1e6:.0f} | {s['decode_device_slots_peak']:,} / {bound:,} "
                  f"| {s['device_bytes_saved'] / 1e6:.1f} | {r['leaked_slots']} | {r['invariant_violations']} |",
                  flush=True)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
        for dbs in sorted({r[0] for r in rows}):
            pts = [r for r in rows if r[0] == dbs]
            a.plot([p[1] for p in pts], [p[2] for p in pts], marker="o", label=f"buffer {dbs}")
            b.plot([p[1] for p in pts], [p[3] / 1e9 for p in pts], marker="o", label=f"buffer {dbs}")
        a.set_xlabel("--topk-locality")
        a.set_ylabel("buffer hit rate")
        b.set_xlabel("--topk-locality")
        b.set_ylabel("GB host -> device")
        a.legend()
        fig.tight_layout()
        fig.savefig(args.plot)


if __name__ == "__main__":
    main()

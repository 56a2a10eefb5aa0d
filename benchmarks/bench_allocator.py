"""Free + alloc of one batch of slots, at several pool sizes; and kvcore's batch calls.

Compares kvcore's ring-buffer allocator with SGLang's (when importable) or else
with a naive free list that, like SGLang, concatenates the whole free list on
every free and slices it on every alloc.  ``--batch-calls`` also times kvcore's
``alloc_extend`` + ``free``, ``alloc_decode`` + ``free`` of the new pages, and an
ownership ``check_claimable(commit=True)`` + ``disown``, for 1, 8 and 64 requests
(no other implementation: these compare kvcore with itself across a change).

    python benchmarks/bench_allocator.py [--device cpu] [--batch 256] [--batch-calls] [--json]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import torch

try:
    from kvcore.pools import TokenToKVPoolAllocator
except ImportError:  # run from a checkout without installing
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from kvcore.pools import TokenToKVPoolAllocator


class NaiveCatAllocator:
    """SGLang's need_sort=False free list: torch.cat of the whole list on free."""

    def __init__(self, size: int, page_size: int, device: str) -> None:
        self.page_size = page_size
        self.device = device
        self.offsets = torch.arange(page_size, device=device)
        self.free_pages = torch.arange(1, size // page_size + 1, dtype=torch.int64, device=device)

    def alloc(self, need_size: int) -> torch.Tensor | None:
        k = need_size // self.page_size
        if k > len(self.free_pages):
            return None
        out, self.free_pages = self.free_pages[:k], self.free_pages[k:]
        if self.page_size == 1:
            return out
        return (out[:, None] * self.page_size + self.offsets).reshape(-1)

    def free(self, free_index: torch.Tensor) -> None:
        pages = free_index if self.page_size == 1 else torch.unique(free_index // self.page_size)
        # SGLang appends freed slots at the back, but puts freed pages in front.
        self.free_pages = torch.cat((self.free_pages, pages) if self.page_size == 1 else (pages, self.free_pages))


def sglang_factory() -> Callable[[int, int, str], Any] | None:
    try:
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator  # type: ignore[import-not-found]
        from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator as SglTokenAllocator  # type: ignore[import-not-found]
    except Exception:
        return None

    def make(size: int, page_size: int, device: str) -> Any:
        if page_size == 1:
            return SglTokenAllocator(size, torch.float16, device, None, False)
        return PagedTokenToKVPoolAllocator(size, page_size, torch.float16, device, None, False)

    return make


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_free_alloc(alloc: Any, batch: int, iters: int, device: str, repeat: int = 3,
                    clock: Callable[[], float] = time.perf_counter) -> float:
    """Microseconds per (free one batch, alloc one batch); the pool stays almost all free,
    so the free list is as long as the pool: the case a whole-list copy pays for."""
    held = [alloc.alloc(batch) for _ in range(8)]
    # Touch a few batches first so lazy init and caches settle.
    for _ in range(10):
        alloc.free(held.pop(0))
        held.append(alloc.alloc(batch))
    best = float("inf")
    # Best of a few rounds: this measures the allocator, not other load on the machine.
    for _ in range(repeat):
        sync(device)
        t0 = clock()
        for _ in range(iters):
            alloc.free(held.pop(0))
            held.append(alloc.alloc(batch))
        sync(device)
        best = min(best, (clock() - t0) / iters * 1e6)
    return best


def time_call(fn: Callable[[], None], iters: int, device: str, repeat: int,
              clock: Callable[[], float] = time.perf_counter) -> float:
    """Microseconds per ``fn()``, best of ``repeat`` rounds of ``iters`` calls."""
    for _ in range(10):
        fn()
    best = float("inf")
    for _ in range(repeat):
        sync(device)
        t0 = clock()
        for _ in range(iters):
            fn()
        sync(device)
        best = min(best, (clock() - t0) / iters * 1e6)
    return best


def batch_calls(reqs: int, device: str) -> dict[str, Callable[[], None]]:
    """kvcore's alloc_extend, alloc_decode and ownership claims for ``reqs`` requests (page 16, 64k slots)."""
    p = 16
    a = TokenToKVPoolAllocator(1 << 16, p, device)
    held = a.alloc(reqs * 2 * p)
    assert held is not None
    # Each request holds two pages: a prefix of p + 5 tokens ends at offset 4 of its second page.
    pre = [p + 5] * reqs
    seq = [p + 5 + 40] * reqs
    last = torch.tensor([int(held[i * 2 * p + p + 4]) for i in range(reqs)], device=device)
    ext = sum(seq) - sum(pre)
    # Tokens 21..31 fill the prefix's page; 32..47 and 48..60 take two new pages.
    new_pages = torch.tensor([i * 40 + k for i in range(reqs) for k in (11, 27)], device=device)

    def extend() -> None:
        out = a.alloc_extend(pre, pre, seq, seq, last, ext)
        assert out is not None
        a.free(out[new_pages])  # one slot of each new page gives the page back

    # Decode: every other request opens a page (its position is page-aligned), the rest continue.
    dseq = [2 * p + 1 if i % 2 else p + 6 for i in range(reqs)]
    dlast = torch.tensor([int(held[i * 2 * p + (2 * p - 1 if i % 2 else p + 4)]) for i in range(reqs)],
                         device=device)
    opens = torch.tensor([i for i in range(reqs) if i % 2], dtype=torch.int64, device=device)

    def decode() -> None:
        out = a.alloc_decode(dseq, dseq, dlast)
        assert out is not None
        if opens.numel():
            a.free(out[opens])

    def claim() -> None:
        a.check_claimable(held, commit=True)
        a.disown(held)

    return {"extend+free": extend, "decode+free": decode, "claim+disown": claim}


def batch_call_rows(device: str, iters: int, repeat: int, clock: Callable[[], float]) -> list[dict[str, Any]]:
    rows = []
    for reqs in (1, 8, 64):
        for name, fn in batch_calls(reqs, device).items():
            us = time_call(fn, iters, device, repeat, clock)
            rows.append({"op": name, "requests": reqs, "kvcore_us": round(us, 2)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=256, help="slots per free and per alloc")
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--repeat", type=int, default=3, help="rounds of --iters; the best is reported")
    ap.add_argument("--sizes", default="65536,1048576,4194304", help="pool sizes in slots")
    ap.add_argument("--page-sizes", default="1,16")
    ap.add_argument("--clock", choices=["auto", "cpu", "wall"], default="auto",
                    help="cpu: this process's CPU time (steadier on a shared machine); wall: elapsed time; "
                         "auto (default): cpu on the cpu device, wall elsewhere")
    ap.add_argument("--batch-calls", action="store_true", help="also time alloc_extend, alloc_decode and claims")
    ap.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    args = ap.parse_args()
    torch.set_num_threads(1)
    use_cpu = args.clock == "cpu" or (args.clock == "auto" and args.device == "cpu")
    clock = time.process_time if use_cpu else time.perf_counter

    sgl = sglang_factory()
    impls: dict[str, Callable[[int, int, str], Any]] = {
        "kvcore": lambda s, p, d: TokenToKVPoolAllocator(s, p, d),
        "sglang" if sgl else "naive-cat": sgl or NaiveCatAllocator,
    }
    rows = []
    for p in (int(x) for x in args.page_sizes.split(",")):
        for size in (int(x) for x in args.sizes.split(",")):
            row: dict[str, Any] = {"page_size": p, "pool_slots": size, "batch": args.batch}
            for name, make in impls.items():
                us = time_free_alloc(make(size, p, args.device), args.batch, args.iters, args.device, args.repeat,
                                     clock)
                row[f"{name}_us"] = round(us, 2)
            rows.append(row)
    calls = batch_call_rows(args.device, args.iters, args.repeat, clock) if args.batch_calls else []

    if args.json:
        print(json.dumps({"device": args.device, "torch": torch.__version__, "clock": "cpu" if use_cpu else "wall",
                          "rows": rows, "batch_calls": calls}, indent=2))
        return
    names = list(impls)
    print(f"free+alloc of {args.batch}-slot batches, us per batch (device {args.device}, torch {torch.__version__}, "
          f"{'cpu' if use_cpu else 'wall'} time)")
    print(f"{'page':>5} {'pool slots':>11} " + " ".join(f"{n + ' us':>13}" for n in names))
    for r in rows:
        print(f"{r['page_size']:>5} {r['pool_slots']:>11} " + " ".join(f"{r[n + '_us']:>13.2f}" for n in names))
    for c in calls:
        print(f"{c['op']:>13} {c['requests']:>3} requests {c['kvcore_us']:>10.2f} us (kvcore, page 16)")


if __name__ == "__main__":
    main()

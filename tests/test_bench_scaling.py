"""benchmarks/bench_scaling.py on small sizes, a windowed backend beside radix (no timing is checked)."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest

from tools.sglang_loader import default_src

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_scaling.py"
SRC = default_src()


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_scaling_under_test", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _args(**over) -> argparse.Namespace:
    args = dict(backends="radix,swa", prompt_lens=[1024], chunk=256, max_len=None, tree_sizes=[60], max_leaves=None,
                evict_calls=3, repeat=1, clock="cpu", sglang_src=SRC, no_sglang=SRC is None, quiet=True)
    args.update(over)
    return argparse.Namespace(**args)


def test_prompt_and_evict_figures_for_every_backend(bench):
    out = bench.measure(_args())
    for name in ("radix", "swa"):
        assert out["prompt_ns_per_token"][name]["1024"] > 0
        assert out["evict_ms_per_call"][name]["60"] > 0


@pytest.mark.skipif(SRC is None, reason="SGLang source not found (set KVCORE_SGLANG_SRC)")
def test_only_single_free_list_backends_are_compared_with_sglangs_victims(bench):
    # swa's two-pool allocator has no one free list to set beside RadixCache's: it is left out, not a crash.
    out = bench.measure(_args())
    assert out["same_victims"] == {"60": {"radix": True}}

"""benchmarks/bench_radix.py runs on a tiny trace in every key mode (no timing is checked)."""

import importlib.util
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[3] / "benchmarks" / "bench_radix.py"
SMALL = ["--requests", "12", "--req-len", "40", "--prompt-len", "16", "--num-prompts", "2", "--repeat", "1",
         "--page-sizes", "1", "4", "--no-sglang", "--rust-core", "off", "--json"]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_radix_under_test", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("mode", ["fresh", "reused", "array"])
def test_key_modes_run_and_agree(bench, capsys, mode):
    assert bench.main(SMALL + ["--key-mode", mode]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["key_mode"] == mode and [r["page_size"] for r in out["rows"]] == [1, 4]
    assert all(r["radix"]["same_match"] and r["radix"]["matched_tokens"] > 0 for r in out["rows"])


def test_missing_backend_skipped_with_a_note(bench, capsys):
    assert bench.main(SMALL + ["--backends", "radix,no-such-backend"]) == 0
    captured = capsys.readouterr()
    assert "'no-such-backend' is not installed" in captured.err
    assert json.loads(captured.out)["backends"] == ["radix"]


def test_backend_options_reach_the_backend(bench, capsys):
    assert bench.main(SMALL + ["--backend-opt", "radix:bogus=1"]) == 2
    assert "unknown option 'bogus'" in capsys.readouterr().err
    assert bench.parse_backend_opts(["radix:strict=false", "eviction_policy=lfu"], ["radix", "swa"]) == {
        "radix": {"strict": False, "eviction_policy": "lfu"}, "swa": {"eviction_policy": "lfu"}}

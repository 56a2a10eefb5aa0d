"""kvcore bench: every workload on every installed backend, the JSON schema, plots, errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

import kvcore
from kvcore.bench import run_bench
from kvcore.bench.trace import generate_sample_trace, load_trace, sample_trace_path
from kvcore.bench.workloads import WORKLOADS, make_workload, workloads_table
from kvcore.cli import app

INSTALLED = [b for b in ("chunk", "radix", "swa", "swa-chunk") if b in kvcore.available_backends()]
WORKLOAD_NAMES = list(WORKLOADS)
# Small pools so eviction, retraction and session release all happen in a fraction of a second.
SMALL = dict(size=8192, max_num_reqs=24, chunk_size=512, window=64, swa_interval=8)
SCHEMA_KEYS = [
    "backend", "device", "workload", "seed", "workload_digest", "num_requests", "prompt_tokens", "cached_tokens",
    "hit_rate", "infinite_cache_hit_rate", "pools", "retractions", "evictions", "wall_s", "requests_per_s",
    "tokens_per_s", "step_p50_us", "step_p99_us", "leaked_slots", "invariant_violations", "backend_s",
    "loop_overhead_s",
]
TIMING_KEYS = {"wall_s", "backend_s", "loop_overhead_s", "kv_write_s", "requests_per_s", "tokens_per_s",
               "step_p50_us", "step_p99_us", "step_mean_us"}

runner = CliRunner()


def _n(workload: str) -> int:
    return {"long-decode": 6, "multi-turn": 30, "sparse-decode": 2}.get(workload, 20)


@pytest.mark.parametrize("backend", INSTALLED)
@pytest.mark.parametrize("workload", WORKLOAD_NAMES)
def test_every_workload_runs_without_leaks(backend, workload):
    page = 4 if workload in ("zipf", "trace") else 1  # paged allocation too
    num = _n(workload)
    opts = SMALL | ({"size": 65536} if workload == "sparse-decode" else {})  # its contexts are 8K-32K tokens
    (rep,) = run_bench([backend], workload=workload, num_requests=num, seed=1, check_every=13, page_size=page,
                       **opts)
    assert rep["leaked_slots"] == 0
    assert rep["leaked_rows"] == 0
    assert rep["invariant_violations"] == 0, rep["violations"]
    assert rep["invariant_checks"] > 1
    assert rep["num_requests"] == num
    assert 0.0 <= rep["hit_rate"] <= rep["infinite_cache_hit_rate"] + 1e-9 <= 1.0 + 1e-9
    if backend in ("chunk", "swa-chunk") and workload != "multi-turn":
        assert rep["cached_tokens"] == 0
    pools = {p["name"]: p for p in rep["pools"]}
    if kvcore.available_backends()[backend].config.model_fields.get("sliding_window_size"):
        assert list(pools) == ["full", "swa"]
        bound = SMALL["window"] + SMALL["swa_interval"] - 1 + 2 * page
        assert rep["window_bound"] == bound
        assert rep["window_per_request_peak"] is not None and rep["window_per_request_peak"] <= bound
    else:
        assert list(pools) == ["full"] and rep["window_per_request_peak"] is None
    for p in pools.values():
        assert p["leaked"] == 0
        assert p["available"] + p["evictable"] + p["protected"] == p["capacity"]
        assert p["peak"] <= p["peak_occupied"] <= p["capacity"]


def test_pressure_retracts_and_evicts_without_leaks():
    (rep,) = run_bench(["radix" if "radix" in INSTALLED else "chunk"], workload="long-decode", num_requests=10,
                       size=4096, max_num_reqs=8, chunk_size=256, check_every=50)
    assert rep["retractions"] > 0
    assert rep["leaked_slots"] == 0 and rep["invariant_violations"] == 0


def test_sessions_reuse_and_release_under_pressure():
    reps = run_bench(["chunk"], workload="multi-turn", num_requests=40, size=4096, max_num_reqs=4,
                     chunk_size=512, check_every=10)
    rep = reps[0]
    assert rep["cached_tokens"] > 0  # follow-up turns reuse the session's KV even without a tree
    assert rep["session_releases"] > 0
    assert rep["leaked_slots"] == 0 and rep["invariant_violations"] == 0
    (off,) = run_bench(["chunk"], workload="multi-turn", num_requests=40, sessions=False, size=4096,
                       max_num_reqs=4, chunk_size=512)
    assert off["cached_tokens"] == 0


def test_write_kv_moves_bytes_on_cpu():
    (rep,) = run_bench(["chunk"], workload="no-reuse", num_requests=8, write_kv=True, kv_layers=1, kv_heads=1,
                       kv_head_dim=8, **SMALL)
    assert rep["kv_bytes_written"] >= (rep["prompt_tokens"] + rep["output_tokens"]) * 2 * 1 * 1 * 8 * 2
    assert rep["leaked_slots"] == 0


def test_determinism_same_seed_same_numbers():
    def run(seed):
        return run_bench(INSTALLED[-1:], workload="zipf", num_requests=40, seed=seed, **SMALL)[0]

    a, b, c = run(3), run(3), run(4)
    strip = lambda r: {k: v for k, v in r.items() if k not in TIMING_KEYS and k != "_timeline"}  # noqa: E731
    assert strip(a) == strip(b)
    assert a["workload_digest"] == b["workload_digest"] != c["workload_digest"]


def test_workload_digest_covers_content():
    a = make_workload("shared-prefix", seed=0, num_requests=20)
    b = make_workload("shared-prefix", seed=0, num_requests=20)
    assert a.digest == b.digest
    b.requests[5].output[0] += 1
    b._digest = None
    assert a.digest != b.digest


def test_shipped_sample_trace_replays():
    path = sample_trace_path()
    assert path.is_file()
    wl = load_trace(None)
    assert len(wl.requests) == sum(1 for line in path.read_text().splitlines() if line.strip())
    first = json.loads(path.read_text().splitlines()[0])
    assert not wl.requests[0].prompt  # streamed: no tokens until the request arrives
    for r in wl.requests:
        r.materialise()
    assert len(wl.requests[0].prompt) == wl.requests[0].prompt_len == first["input_length"]
    assert len(wl.requests[0].output) == wl.requests[0].output_len == first["output_length"]
    # equal hash ids give equal blocks
    shared = [r for r in wl.requests if r.prompt[:512] == wl.requests[0].prompt[:512]]
    assert len(shared) > 1
    wl.requests[0].release()
    assert not wl.requests[0].prompt and wl.requests[0].prompt_len == first["input_length"]


def test_generated_trace_round_trips(tmp_path):
    p = tmp_path / "t.jsonl"
    generate_sample_trace(p, num_requests=30, seed=5)
    wl = load_trace(str(p), num_requests=10)
    assert len(wl.requests) == 10
    assert wl.digest == load_trace(str(p), num_requests=10).digest


# ------------------------------------------------------------------------- CLI


def _json(args):
    res = runner.invoke(app, ["bench", *args, "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def test_cli_json_schema_single_backend():
    rep = _json(["--backend", "chunk", "-w", "no-reuse", "-n", "12", "--size", "8192", "--no-reference"])
    assert isinstance(rep, dict)
    for key in SCHEMA_KEYS:
        assert key in rep, key
    assert list(rep)[:2] == ["schema_version", "backend"] and rep["schema_version"] == 2
    assert rep["backend"] == "chunk" and rep["device"] == "cpu" and rep["workload"] == "no-reuse"
    assert len(rep["workload_digest"]) == 64
    (full,) = rep["pools"]
    assert set(full) >= {"name", "capacity", "available", "evictable", "protected", "leaked", "peak", "peak_occupied"}
    assert full["name"] == "full" and full["capacity"] == 8192
    assert not any(k.startswith("_") for k in rep)


def test_cli_compare_gives_a_list_and_a_table():
    names = ",".join(INSTALLED[:3])
    reps = _json(["--compare", names, "-w", "zipf", "-n", "20", "--size", "8192"])
    assert [r["backend"] for r in reps] == INSTALLED[:3]
    assert len({r["workload_digest"] for r in reps}) == 1
    res = runner.invoke(app, ["bench", "--compare", names, "-w", "zipf", "-n", "20", "--size", "8192"])
    assert res.exit_code == 0, res.output
    assert "hit rate" in res.stdout and INSTALLED[0] in res.stdout
    if len(INSTALLED) > 1:
        assert "x)" in res.stdout  # ratios against the first
    md = runner.invoke(app, ["bench", "-b", "chunk", "-b", INSTALLED[-1], "-n", "10", "--markdown"])
    assert md.exit_code == 0 and md.stdout.startswith("| metric |")


@pytest.mark.skipif("swa" not in INSTALLED or "radix" not in INSTALLED, reason="needs swa and radix")
def test_swa_alone_also_runs_radix_for_reference():
    rep = _json(["--backend", "swa", "-w", "long-decode", "-n", "10", "--size", "16384"])
    assert rep["backend"] == "swa" and rep["reference"]["backend"] == "radix"
    pools = {p["name"]: p for p in rep["pools"]}
    assert pools["swa"]["peak"] < pools["full"]["peak"]  # the window pays
    assert rep["reference"]["workload_digest"] == rep["workload_digest"]
    assert "reference" not in _json(["--backend", "swa", "-n", "5", "--no-reference"])


@pytest.mark.skipif("swa" not in INSTALLED, reason="needs swa")
def test_reference_option_overrides_the_spec():
    rep = _json(["--backend", "swa", "-w", "zipf", "-n", "8", "--size", "8192", "--reference", "chunk"])
    assert rep["backend"] == "swa" and rep["reference"]["backend"] == "chunk"
    # A backend that is its own reference runs alone.
    assert "reference" not in _json(["--backend", "chunk", "-n", "5", "--reference", "chunk"])


def test_reference_defaults_to_the_spec_then_radix():
    specs = kvcore.available_backends()
    for name in INSTALLED:
        ref = specs[name].reference or "radix"
        rep = _json(["--backend", name, "-w", "no-reuse", "-n", "4", "--size", "8192"])
        if ref != name and ref in specs:
            assert rep["reference"]["backend"] == ref
        else:
            assert "reference" not in rep


def test_reference_leads_a_comparison():
    names = ",".join(INSTALLED[:2])
    reps = _json(["--compare", names, "--reference", "chunk", "-w", "zipf", "-n", "10", "--size", "8192"])
    assert [r["backend"] for r in reps][0] == "chunk" and len(reps) == len(set(INSTALLED[:2]) | {"chunk"})
    res = runner.invoke(app, ["bench", "--compare", names, "--reference", "chunk", "-n", "10", "--size", "8192"])
    assert res.exit_code == 0 and "chunk (reference)" in res.stdout


def test_one_workload_registry():
    """The CLI help, the docs table, make_workload and kvcore.bench.WORKLOAD_NAMES all read WORKLOADS."""
    import pathlib

    import kvcore.bench

    assert kvcore.bench.WORKLOAD_NAMES == tuple(WORKLOADS)
    help_text = runner.invoke(app, ["bench", "--help"], env={"COLUMNS": "300"}).stdout
    docs = (pathlib.Path(__file__).parents[1] / "docs" / "bench.md").read_text()
    assert workloads_table() in docs  # regenerate the docs table from the registry when this fails
    for name in WORKLOADS:
        assert name in help_text
        assert make_workload(name, num_requests=3).name == name
    with pytest.raises(ValueError, match="choose one of: " + ", ".join(WORKLOADS)):
        make_workload("bogus")


def test_no_backend_name_in_the_loop():
    """Pools by name: the loop, the metrics and the report never name a backend or a pool."""
    import pathlib

    root = pathlib.Path(__file__).parents[1] / "kvcore" / "bench"
    for mod in ("loop.py", "metrics.py", "report.py", "plot.py", "kvwriter.py", "timer.py"):
        text = (root / mod).read_text()
        for word in ("self.swa", "supports_swa", "is_swa_backend", '"swa"', "'swa'", "full_available_size",
                     "swa_available_size", "full_attn_allocator"):
            assert word not in text, (mod, word)


def test_cli_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "run.png"
    res = runner.invoke(app, ["bench", "--compare", ",".join(INSTALLED[:2]), "-n", "10", "--plot", str(out)])
    assert res.exit_code == 0, res.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_trace_option():
    rep = _json(["--backend", "chunk", "--trace", str(sample_trace_path()), "-n", "15"])
    assert rep["workload"] == "trace" and rep["num_requests"] == 15


def _main(capsys, *args):
    """kvcore.cli.main in-process: the same error handling as the console script."""
    from kvcore.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["bench", *args])
    out = capsys.readouterr()
    return exc.value.code, out.out, out.err


@pytest.mark.parametrize(
    "args, needle, status",
    [
        (["--backend", "nope"], "nope", 2),
        (["--backend", "chunk", "--device", "tpu"], "tpu", 1),  # a device not usable here: 1
        (["--backend", "chunk", "--workload", "bogus"], "bogus", 2),
        (["--backend", "chunk", "--trace", "/no/such/file.jsonl"], "/no/such/file.jsonl", 2),
        (["--backend", "chunk", "--size", "0"], "--size", 2),
        (["--backend", "chunk", "--plot", "out.txt"], "png", 2),
        (["--backend", "chunk", "--device", "npu"], "npu", 1),
        ([], "--backend", 2),
    ],
)
def test_cli_errors_are_one_line(capsys, args, needle, status):
    code, out, err = _main(capsys, *args)
    assert code == status, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("kvcore: error:") and needle in lines[0]
    assert out == ""


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="CUDA is present here")
def test_cli_absent_cuda_is_one_line(capsys):
    code, out, err = _main(capsys, "--backend", "chunk", "--device", "cuda")
    assert code == 1 and err.count("\n") == 1 and "CUDA" in err and out == ""


def test_console_entry_point_error_and_cheap_import():
    """One real process: importing the bench command loads no matplotlib and no plugin; errors are one line."""
    code = (
        "import sys, kvcore.cli; "
        "print('matplotlib' in sys.modules, any(m.startswith('kvcore_') for m in sys.modules), flush=True); "
        "kvcore.cli.main(['bench', '--backend', 'nope'])"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.stdout.split() == ["False", "False"]
    assert proc.returncode == 2  # a usage error
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("kvcore: error:") and "nope" in proc.stderr


def test_bad_trace_line_names_the_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}\n{"timestamp": 1}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        load_trace(str(p))


# ------------------------------------------------------------------ sparse decode (a backend with sparse_top_k() > 0)
def test_topk_selector_locality_and_padding():
    from kvcore.bench.workloads import TopKSelector

    sel = TopKSelector(8, 1.0, seed=0)([5, 100])
    assert sel[0].tolist() == [0, 1, 2, 3, 4, -1, -1, -1]  # a short context: all of it, padded
    assert sel[1].tolist() == list(range(92, 100))  # locality 1: only the most recent tokens
    uniform = TopKSelector(64, 0.0, seed=1)([10_000])[0]
    valid = uniform[uniform >= 0]
    assert valid.numel() == valid.unique().numel() > 48 and int(valid.max()) < 10_000
    assert float(valid.float().mean()) < 8_000  # spread over the context, not bunched at its end
    with pytest.raises(ValueError, match="topk-locality"):
        TopKSelector(8, 1.5)


@pytest.mark.parametrize("page_size", [1, 64])
def test_sparse_decode_on_hisparse_moves_bytes_within_the_buffer_bound(page_size):
    pytest.importorskip("kvcore_hisparse")
    (rep,) = run_bench(["hisparse"], workload="sparse-decode", num_requests=4, seed=2, check_every=7,
                       page_size=page_size, topk_locality=0.5)
    assert rep["leaked_slots"] == 0 and rep["leaked_rows"] == 0
    assert rep["invariant_violations"] == 0, rep["violations"]
    assert [p["name"] for p in rep["pools"]] == ["full", "device", "host"]
    s = rep["backend_stats"]
    assert s["swap_in_tokens"] == s["buffer_misses"] > 0 and s["buffer_hits"] > 0
    assert s["bytes_h2d"] > 0 and s["bytes_d2h"] > 0 and s["device_bytes_saved"] > 0
    # Decoding requests hold at most device_buffer_size + one page each on the device.
    assert s["padded_buffer_size"] == 4096 + page_size
    assert s["device_bound_violations"] == 0
    assert s["decode_device_slots_peak"] <= s["decode_batch_peak"] * s["padded_buffer_size"]


def test_cli_topk_locality_is_checked(capsys):
    res = runner.invoke(app, ["bench", "--backend", "chunk", "--topk-locality", "2"])
    assert res.exit_code != 0

"""Memory-budget pool sizing (kvcore.bench.sizing) and its CLI options.

The hybrid rule is checked against SGLang 0.5.19's own ``HybridSWAPoolConfigurator``
(lifted from ``model_executor/pool_configurator.py`` by AST and run with a stand-in
model config) when its source is unpacked; the rest runs everywhere.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import logging
import os
import types

import pytest
import torch
from typer.testing import CliRunner

import kvcore
from kvcore import Capability
from kvcore.bench import run_bench
from kvcore.bench.sizing import (
    DEFAULT_KV_BUDGET,
    DEFAULT_SWA_MODEL,
    MODELS,
    ModelLayout,
    get_model,
    parse_bytes,
    size_pools,
)
from kvcore.cli import app

INSTALLED = kvcore.available_backends()
needs_swa = pytest.mark.skipif("swa" not in INSTALLED or "radix" not in INSTALLED, reason="kvcore-swa/radix absent")
runner = CliRunner()


def _sglang_configurator_file() -> str | None:
    src = os.environ.get("KVCORE_SGLANG_SRC") or "/tmp/kvcore-ci-sglang-0.5.19/src"
    path = os.path.join(src, "sglang", "srt", "model_executor", "pool_configurator.py")
    return path if os.path.isfile(path) else None


def _sglang_hybrid(model: ModelLayout, ratio: float):
    """SGLang's HybridSWAPoolConfigurator for ``model``: its own __init__ and _solve_pool_sizes."""
    path = _sglang_configurator_file()
    if path is None:
        pytest.skip("SGLang 0.5.19 source not unpacked (KVCORE_SGLANG_SRC)")
    tree = ast.parse(open(path, encoding="utf-8").read())
    wanted = {"MemoryPoolConfig", "HybridSWAPoolConfigurator"}
    body = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name in wanted]
    assert {n.name for n in body} == wanted
    for n in body:  # MemoryPoolConfigurator's base is an ABC we do not need
        n.bases = []
    ns: dict = {
        "dataclass": dataclasses.dataclass, "torch": torch, "logger": logging.getLogger("x"),
        "get_parallel": lambda: types.SimpleNamespace(attn_tp_size=1),
        "get_schedule": lambda: types.SimpleNamespace(swa_full_tokens_ratio=ratio),
        "AttentionArch": types.SimpleNamespace(MLA="mla"), "_dflash_draft_cell_size": lambda kvc: 0,
        "KVCacheConfigurator": object, "__name__": __name__,
    }
    ns["Optional"] = __import__("typing").Optional
    exec(compile(ast.Module(body=body, type_ignores=[]), path, "exec"), ns)
    mc = types.SimpleNamespace(
        full_attention_layer_ids=list(range(model.full_layers)), swa_attention_layer_ids=list(range(model.swa_layers)),
        attention_arch="mha", get_num_kv_heads=lambda tp: model.kv_heads,
        get_swa_num_kv_heads=lambda tp: model.kv_heads,
        head_dim=model.head_dim, v_head_dim=model.head_dim, swa_head_dim=model.head_dim, swa_v_head_dim=model.head_dim,
    )
    kvc = types.SimpleNamespace(
        kv_cache_dtype_str="auto", model_config=mc, kv_cache_dtype=torch.bfloat16, sliding_window_size=model.window,
        page_size=1, spec_algorithm=types.SimpleNamespace(is_eagle=lambda: False, is_standalone=lambda: False),
        is_draft_worker=False,
    )
    return ns["HybridSWAPoolConfigurator"](kvc)


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("ratio", [0.8, 0.5, 0.25])
@pytest.mark.parametrize("budget", [3 << 30, 40 << 30])
@pytest.mark.parametrize("page", [1, 16])
def test_hybrid_rule_matches_sglang(name, ratio, budget, page):
    model = get_model(name)
    sg = _sglang_hybrid(model, ratio)
    sg._page_size = page
    want = sg.calculate_pool_sizes(budget, page)
    got = size_pools(model, budget, hybrid=True, page_size=page, swa_full_tokens_ratio=ratio)
    assert got.cell_bytes == pytest.approx(sg._cell_size)
    assert (got.full, got.swa) == (want.full_max_total_num_tokens, want.swa_max_total_num_tokens)


def test_hybrid_refusal_matches_sglang():
    model = get_model("gemma-3-27b")  # window 1024
    sg = _sglang_hybrid(model, 0.1)
    budget = int(sg._cell_size * 9000)  # 9,000 full tokens -> 900 window tokens < 1024 + 1
    with pytest.raises(ValueError, match="cannot hold even one request"):
        sg.calculate_pool_sizes(budget, 1)
    with pytest.raises(ValueError, match="cannot hold one request"):
        size_pools(model, budget, hybrid=True, swa_full_tokens_ratio=0.1)


def test_full_attention_rule_and_equal_memory():
    m = get_model("gpt-oss-120b")
    per_token = m.kv_heads * 2 * m.head_dim * 2 * (m.full_layers + m.swa_layers)
    full = size_pools(m, 4 << 30, hybrid=False, page_size=16)
    assert full.swa is None and full.full == (4 << 30) // per_token // 16 * 16
    hyb = size_pools(m, 4 << 30, hybrid=True, page_size=16)
    # Both spend no more than the budget; the hybrid pools spend it on more full-pool tokens.
    per_layer = m.per_token_layer
    assert full.full * per_token <= 4 << 30
    assert hyb.full * per_layer * m.full_layers + hyb.swa * per_layer * m.swa_layers <= 4 << 30
    assert hyb.full > full.full and hyb.swa < hyb.full


@pytest.mark.parametrize("bad", [dict(budget=0), dict(ratio=0.0), dict(ratio=1.5), dict(budget=1000)])
def test_bad_sizing_input_is_refused(bad):
    with pytest.raises(ValueError):
        size_pools(get_model("gpt-oss-20b"), bad.get("budget", 1 << 30), hybrid=bad.get("budget") != 1000,
                   swa_full_tokens_ratio=bad.get("ratio", 0.8))


def test_parse_bytes():
    assert parse_bytes("4GiB") == parse_bytes("4g") == 4 << 30
    assert parse_bytes("512 MiB") == 512 << 20 and parse_bytes("1000") == 1000
    for bad in ("", "x", "4QB", "-1G", "0"):
        with pytest.raises(ValueError, match="--kv-budget"):
            parse_bytes(bad)
    with pytest.raises(ValueError, match="unknown model"):
        get_model("llama")


@needs_swa
def test_default_swa_run_is_sized_at_equal_memory():
    res = runner.invoke(app, ["bench", "--backend", "swa", "-n", "12", "--json"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    ref = rep["reference"]
    m = get_model(DEFAULT_SWA_MODEL)
    hyb = size_pools(m, DEFAULT_KV_BUDGET, hybrid=True)
    full = size_pools(m, DEFAULT_KV_BUDGET, hybrid=False)
    assert [(p["name"], p["capacity"]) for p in rep["pools"]] == [("full", hyb.full), ("swa", hyb.swa)]
    assert [(p["name"], p["capacity"]) for p in ref["pools"]] == [("full", full.full)]
    assert rep["options"]["sliding_window_size"] == m.window
    assert rep["options"]["model"] == DEFAULT_SWA_MODEL and rep["options"]["kv_budget"] == DEFAULT_KV_BUDGET
    assert rep["options"]["swa_interval"] == 128  # SGLang's SGLANG_SWA_EVICTION_INTERVAL default
    for r in (rep, ref):
        assert r["leaked_slots"] == 0 and r["invariant_violations"] == 0


@needs_swa
def test_size_keeps_the_old_sizing_and_conflicts_are_refused(capsys):
    res = runner.invoke(app, ["bench", "--backend", "swa", "-n", "4", "--size", "20000", "--json"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    assert rep["options"]["model"] is None and rep["pools"][0]["capacity"] == 20000
    from kvcore.cli import main

    for args, msg in ((["--model", "gpt-oss-20b", "--size", "9000"], "drop --size"),
                      (["--kv-budget", "1GiB"], "name one"),
                      (["--model", "nope"], "unknown model"),
                      (["--model", "gemma-3-27b", "--kv-budget", "64MiB"], "cannot hold"),
                      (["--swa-full-tokens-ratio", "0"], "(0, 1]")):
        with pytest.raises(SystemExit) as exc:
            main(["bench", "--backend", "swa", "-n", "2", *args])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and err.startswith("kvcore: error:") and msg in err, (args, err)


@needs_swa
def test_release_window_lock_lowers_the_window_peak():
    opts = dict(workload="long-decode", num_requests=24, model="gpt-oss-20b", kv_budget=1 << 30, check_every=97)
    (held,) = run_bench(["swa"], **opts)
    (freed,) = run_bench(["swa"], release_window_lock=True, **opts)
    assert held["window_lock_releases"] == 0 and freed["window_lock_releases"] > 0
    peak = {r["options"]["release_window_lock"]: next(p["peak"] for p in r["pools"] if p["name"] == "swa")
            for r in (held, freed)}
    assert peak[True] < peak[False]
    for r in (held, freed):
        assert r["leaked_slots"] == 0 and r["invariant_violations"] == 0, r["violations"]
    # A backend without a window has no window lock: the option changes nothing there.
    (radix,) = run_bench(["radix"], release_window_lock=True, **opts)
    assert radix["window_lock_releases"] == 0 and radix["leaked_slots"] == 0


def test_release_window_lock_needs_the_declared_capability():
    if "swa-pure" not in INSTALLED:
        pytest.skip("kvcore-swa absent")
    # swa-pure has a window but no early window-lock release (nor has SGLang's PureSWARadixCache): what it
    # declares is read, and the run is refused before anything runs.
    cache = kvcore.create_cache("swa-pure", size=64, max_num_reqs=2, max_context_len=32, sliding_window_size=8)
    assert Capability.WINDOWED in cache.capabilities
    assert Capability.WINDOW_LOCK_RELEASE not in cache.capabilities
    with pytest.raises(ValueError, match="--release-window-lock: backend .* cannot release .*WINDOW_LOCK_RELEASE"):
        run_bench(["swa-pure"], workload="long-decode", num_requests=2, size=4096, window=64,
                  release_window_lock=True)


def test_docs_list_the_presets():
    import pathlib

    from kvcore.bench.sizing import models_table

    docs = (pathlib.Path(__file__).parents[1] / "docs" / "bench.md").read_text()
    assert models_table() in docs  # regenerate the docs table from kvcore.bench.sizing.MODELS when this fails

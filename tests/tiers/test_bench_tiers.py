"""``kvcore bench --host-size --store --instances``: reports by tier, K processes on one store, bad options."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvcore.bench.instances import run_share, split_workload
from kvcore.bench.spec import RequestSpec, Workload
from kvcore.cli import app

runner = CliRunner()
SMALL = ["--workload", "shared-prefix", "-n", "16", "--page-size", "16", "--size", "16384"]


def test_one_instance_reports_store_and_host_pool():
    res = runner.invoke(app, ["bench", "--backend", "radix", *SMALL, "--host-size", "512",
                              "--store", "memory://?max_bytes=200000000", "--json"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    assert set(rep["store"]) == {"hits", "misses", "errors", "bytes_read", "bytes_written", "round_trips"}
    assert rep["store"]["bytes_written"] > 0 and rep["store"]["errors"] == 0
    assert "host" in [p["name"] for p in rep["pools"]]
    t = rep["tiers"]
    assert t["device_hit_tokens"] + t["host_hit_tokens"] + t["store_hit_tokens"] == rep["cached_tokens"]
    assert rep["leaked_slots"] == 0 and rep["invariant_violations"] == 0


def test_two_instances_share_prefixes_through_a_file_store(tmp_path):
    res = runner.invoke(app, ["bench", "--backend", "radix", *SMALL, "--instances", "2",
                              "--store", f"file://{tmp_path / 'store'}", "--json"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    assert rep["instances"] == 2 and len(rep["per_instance"]) == 2
    # The two run at once, so which one computes a shared prefix first is a race: no hit count is asserted here.
    assert rep["store"]["errors"] == 0 and rep["store"]["bytes_written"] > 0
    assert rep["infinite_cache_hit_rate"] >= rep["isolated_infinite_hit_rate"]
    assert rep["leaked_slots"] == 0 and rep["invariant_violations"] == 0


def test_an_instance_after_another_loads_its_prefixes_from_the_store(tmp_path):
    config = {"page_size": 16, "size": 16384, "store": f"file://{tmp_path / 'store'}"}
    first = run_share(0, 2, "radix", "shared-prefix", 0, 16, None, 20.0, config)
    second = run_share(1, 2, "radix", "shared-prefix", 0, 16, None, 20.0, config)
    assert first["tiers"]["store_hit_tokens"] == 0
    assert second["tiers"]["store_hit_tokens"] > 0 and second["store"]["hits"] > 0
    assert second["store"]["errors"] == 0
    assert first["leaked_slots"] == second["leaked_slots"] == 0
    assert first["invariant_violations"] == second["invariant_violations"] == 0


def test_split_keeps_sessions_together():
    reqs = [RequestSpec(f"r{i}", i, [1, 2, 3], [4], session_id=f"s{i % 3}", turn=i // 3) for i in range(9)]
    shares = split_workload(Workload("w", 0, reqs), 2)
    assert [sorted({r.session_id for r in s.requests}) for s in shares] == [["s0", "s2"], ["s1"]]
    assert sum(len(s.requests) for s in shares) == 9


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--store", "gopher://x"], "no store for scheme"),
        (["--host-size", "10"], "host_size=10 is not a multiple of page_size"),
        (["--instances", "2", "--store", "memory://"], "private to one"),
        (["--instances", "0"], "--instances: Input should be greater than or equal to 1"),
        (["--host-write-policy", "write_back"], "needs a tier to write to"),
        (["--host-size", "512", "--host-write-policy", "later"], "option 'host_write_policy': Input should be"),
    ],
)
def test_bad_tier_options_are_one_line_errors(args, match):
    res = runner.invoke(app, ["bench", "--backend", "radix", *SMALL, *args])
    assert res.exit_code != 0
    assert match in res.output + str(res.exception)  # kvcore's main prints it as one line


def test_a_backend_without_tiers_is_refused():
    res = runner.invoke(app, ["bench", "--backend", "chunk", *SMALL, "--store", "memory://"])
    assert res.exit_code != 0
    assert "takes no host tier or store" in res.output + str(res.exception)


@pytest.mark.parametrize("policy", ["write_through_selective", "write_back"])
def test_host_write_policy_option(policy):
    res = runner.invoke(app, ["bench", "--backend", "radix", "--workload", "shared-prefix", "-n", "24",
                              "--page-size", "16", "--size", "2048", "--host-size", "4096",
                              "--host-write-policy", policy, "--json"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    assert rep["tiers"]["host_hit_tokens"] > 0
    assert (rep["tiers"]["written_back_pages"] > 0) == (policy == "write_back")
    assert rep["leaked_slots"] == 0 and rep["invariant_violations"] == 0


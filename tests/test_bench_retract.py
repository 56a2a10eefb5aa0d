"""kvcore bench --retract-mode: a recompute-retracted request re-prefills prompt + outputs (SGLang's fill_ids)."""

from __future__ import annotations

import pytest

import kvcore
from kvcore.bench import run_bench
from kvcore.engine import Engine

# Small pools: long decodes that outgrow them, so the newest running request is retracted.
OPTS = dict(workload="long-decode", num_requests=6, seed=3, size=3072, max_num_reqs=6, window=64, check_every=41)


def _installed(backend: str) -> None:
    if backend not in kvcore.available_backends():
        pytest.skip(f"backend {backend!r} is not installed")


class _Spy:
    """Counts decode slots and records every prefill chunk (rid, first position, end, outputs held)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.decoded = 0
        self.chunks: list[tuple[str, int, int, int]] = []
        alloc_decode, extend = Engine.alloc_decode, Engine.extend

        def spy_alloc_decode(eng, rows, *a, **kw):
            slots = alloc_decode(eng, rows, *a, **kw)
            if slots is not None:
                self.decoded += int(rows.numel())
            return slots

        def spy_extend(eng, req, end=None, **kw):
            start = req.kv.kv_allocated_len
            ok = extend(eng, req, end, **kw)
            if ok:
                self.chunks.append((req.rid, start, req.kv.kv_allocated_len, len(req.output_ids)))
            return ok

        monkeypatch.setattr(Engine, "alloc_decode", spy_alloc_decode)
        monkeypatch.setattr(Engine, "extend", spy_extend)


@pytest.mark.parametrize("backend", ["radix", "swa", "mamba"])
def test_recompute_prefills_prompt_and_outputs_and_decodes_each_token_once(backend, monkeypatch):
    _installed(backend)
    spy = _Spy(monkeypatch)
    (rep,) = run_bench([backend], retract_mode="recompute", **OPTS)
    assert rep["retractions"] > 0
    assert rep["leaked_slots"] == 0 and rep["leaked_rows"] == 0
    assert rep["invariant_violations"] == 0, rep["violations"]
    # Every output token is decoded exactly once: a retracted request's outputs come back by prefill.
    assert spy.decoded == rep["output_tokens"]
    again = [c for c in spy.chunks if c[3] > 0]
    assert again, "no request was re-prefilled with its outputs"
    assert rep["retract_recomputed_tokens"] > 0
    assert rep["retract_offload_bytes"] == 0 and rep["retract_loaded_tokens"] == 0


@pytest.mark.parametrize("backend", ["radix", "mamba"])
def test_offload_resumes_without_prefill(backend, monkeypatch):
    _installed(backend)
    spy = _Spy(monkeypatch)
    (rep,) = run_bench([backend], retract_mode="offload", **OPTS)
    assert rep["retractions"] > 0 and rep["retract_loaded_tokens"] > 0
    assert rep["leaked_slots"] == 0 and rep["leaked_rows"] == 0
    assert rep["invariant_violations"] == 0, rep["violations"]
    # A resumed request decodes its last position again (the backup holds seqlen - 1): one step per resume.
    assert rep["output_tokens"] < spy.decoded
    assert not [c for c in spy.chunks if c[3] > 0]  # no prefill of outputs: the KV came back from the host


def test_the_report_counts_recomputed_positions():
    _installed("radix")
    (rep,) = run_bench(["radix"], retract_mode="recompute", **OPTS)
    assert rep["retract_mode"] == "recompute"
    assert rep["retract_recomputed_tokens"] > 0


def test_pd_decode_recompute_comes_back_as_a_transfer_of_seqlen_minus_one(monkeypatch):
    _installed("radix")
    spy = _Spy(monkeypatch)
    (rep,) = run_bench(["radix"], workload="pd-decode", num_requests=30, seed=2, size=1500, max_num_reqs=16,
                       check_every=7, retract_mode="recompute")
    assert rep["retractions"] > 0
    assert rep["leaked_slots"] == 0 and rep["leaked_rows"] == 0
    assert rep["invariant_violations"] == 0, rep["violations"]
    assert rep["pd_preallocated"] == 30 + rep["retractions"]  # each retracted request is transferred again
    # The transfer brings prompt + outputs but the last (SGLang's rebootstrap): at most one position per
    # retraction is decoded again, never the outputs.
    assert rep["output_tokens"] <= spy.decoded <= rep["output_tokens"] + rep["retractions"]

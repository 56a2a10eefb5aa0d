"""Real SGLang on hybrid models on the CPU: kvcore's caches for a hybrid sliding-window model.

A tiny random-weight Gemma 4 text model (``harness.build_tiny_gemma4``: two 32-token sliding-window
layers, two full layers), which SGLang runs as a hybrid SWA model (its ``SWATokenToKVPoolAllocator``
and, by default, its ``UnifiedRadixCache`` with FULL + SWA components). SGLang refuses the
torch-native attention backend for Gemma 4, so these engines run SGLang's Triton attention backend,
interpreted on the CPU (``TRITON_INTERPRET=1``): slow, hence a short workload (shared prefixes,
then second turns, prompts longer than the window and the prefill chunk) at page size 1. For each
``kvcore-*`` name that serves a hybrid SWA model, greedy tokens and ``cached_tokens`` must equal
the default cache's; the log must show the kvcore backend and no failure (SGLang's idle check of
both pools, and its tree sanity check, raise on a leak; see ``test_engine_full_attention``). The
``sgl_kernel`` stand-in is the same as there.

Hybrid SSM models could not run on SGLang's CPU path, read from SGLang's source (0.5.19 and
0.5.23): the Mamba2 mixer (``layers/attention/mamba/mamba.py``: NemotronH, FalconH1, Mamba2,
Granite hybrids) binds its ``causal_conv1d_fn`` / ``causal_conv1d_update`` only on CUDA, NPU and
XPU, so its forward has no convolution on a CPU (0.5.23's model registry even skips ``mamba`` for
it); Qwen3-Next's and Kimi-Linear's linear attention (``linear/gdn_backend.py``,
``kda_backend.py``) call ``sgl_kernel``'s compiled CPU kernels (``sgl_kernel.mamba.causal_conv1d_*_cpu``,
``torch.ops.sgl_kernel.fused_gdn_gating_cpu``), which a stand-in cannot compute. So kvcore-mamba and
kvcore-unified on SSM models are covered by the request-path differentials only.
"""

from __future__ import annotations

from importlib.metadata import version
from pathlib import Path

import pytest

from plugins.sglang.tests.engine.harness import Config, leak_lines, served_names, tree_cache_lines

SGLANG = version("sglang")
# An empty list would skip silently ("got empty parameter set"): say why instead.
SWA_NAMES = served_names("hybrid-swa") or [pytest.param(
    None, marks=pytest.mark.skip(reason=f"kvcore-sglang serves no hybrid SWA model on SGLang {SGLANG} "
                                        "(its README: what each release is served)"))]
TRITON = (("attention_backend", "triton"),)


@pytest.mark.parametrize("name", SWA_NAMES)
def test_hybrid_swa_engine_matches_sglang(engine_run, tiny_gemma4: Path, name: str) -> None:
    want = engine_run(Config(None, 1, model="gemma4", extra=TRITON), model=tiny_gemma4)
    assert not leak_lines(want.log), leak_lines(want.log)[:20]
    lines = tree_cache_lines(want.log)
    assert lines == [("default", "UnifiedRadixCache")], lines
    assert "hybrid_swa=True" in want.log
    assert any(a.cached_tokens for r in want.rounds.values() for a in r), want.rounds

    got = engine_run(Config(name, 1, model="gemma4", extra=TRITON), model=tiny_gemma4)
    assert not leak_lines(got.log), leak_lines(got.log)[:20]
    lines = tree_cache_lines(got.log)
    assert [src for src, _ in lines] == [f"registered('{name}')"], lines
    for round_name, answers in want.rounds.items():
        for i, (a, b) in enumerate(zip(got.rounds[round_name], answers, strict=True)):
            where = f"{name} (SGLang {SGLANG}): round {round_name!r}, request {i}"
            assert a.cached_tokens == b.cached_tokens, f"{where}: cached_tokens {a.cached_tokens} != {b.cached_tokens}"
            assert a.output_ids == b.output_ids, f"{where}: tokens {a.output_ids} != {b.output_ids}"

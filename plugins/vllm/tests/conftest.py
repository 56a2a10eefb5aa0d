"""kvcore-vllm's tests run real vLLM 0.32 (CPU build), which lives in .venv-vllm (``./dev test`` runs them there).

In an environment without vLLM (kvcore's own .venv) nothing here is collected.
Engines run a tiny random-weight Llama built here with transformers; Redis
servers are real ``redis-server`` processes (kvcore-redis's fixtures).  Nothing
is stubbed.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import pytest

collect_ignore_glob = [] if importlib.util.find_spec("vllm") is not None else ["test_*.py"]

if importlib.util.find_spec("vllm") is not None:
    from kvcore_redis.fixtures import redis_server  # noqa: F401  (a pytest fixture)
    from kvcore_vllm.runs import engine_env, run_engine, shared_prefix_prompts, tiny_llama

    # In-process engines in this pytest process: vLLM reads these when an engine starts.
    os.environ.update(engine_env(multiprocess=False))

#: Tokens each request generates.
MAX_TOKENS = 6


@pytest.fixture(scope="session")
def prompts() -> list[list[int]]:
    return shared_prefix_prompts()


@pytest.fixture(scope="session")
def model_a(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tiny_llama(tmp_path_factory.mktemp("llama-a"), seed=0))


@pytest.fixture(scope="session")
def model_b(tmp_path_factory: pytest.TempPathFactory) -> str:
    # Model A's shape (same KV layout, dtype and block size): only the weights and the name differ.
    return str(tiny_llama(tmp_path_factory.mktemp("llama-b"), seed=1))


@pytest.fixture(scope="session")
def reference_a(model_a: str, prompts: list[list[int]]) -> dict[str, Any]:
    """Model A without any connector: the tokens every run of it must give."""
    return run_engine(model_a, None, prompts, MAX_TOKENS)

"""Fixtures of the real-engine tests: the tiny model, a log folder, each configuration's run once per session.

Collected only where SGLang is installed (its venvs), as the rest of kvcore-sglang's tests.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

collect_ignore_glob = [] if importlib.util.find_spec("sglang") is not None else ["test_*.py"]


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from plugins.sglang.tests.engine.harness import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_gemma4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from plugins.sglang.tests.engine.harness import build_tiny_gemma4

    return build_tiny_gemma4(tmp_path_factory.mktemp("tiny-gemma4"))


@pytest.fixture(scope="session")
def engine_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engine-logs")


@pytest.fixture(scope="session")
def engine_run(tiny_llama: Path, engine_logs: Path):
    """``engine_run(config, http=False, model=None)``: the workload's answers under ``config``, each run once.

    Each run starts its engine (or server), runs the workload (the whole one on the tiny Llama, the
    short one on another ``model``), and stops it before returning.
    """
    from plugins.sglang.tests.engine.harness import Config, Result, run_config

    done: dict[tuple[Config, bool, Path | None], Result] = {}

    def run(config: Config, http: bool = False, model: Path | None = None) -> Result:
        key = (config, http, model)
        if key not in done:
            done[key] = run_config(model or tiny_llama, config, engine_logs, http=http, small=model is not None)
        return done[key]

    return run

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
def engine_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engine-logs")


@pytest.fixture(scope="session")
def engine_run(tiny_llama: Path, engine_logs: Path):
    """``engine_run(config, http=False)``: the workload's answers under ``config``, each configuration run once.

    Each run starts its engine (or server), runs the whole workload, and stops it before returning.
    """
    from plugins.sglang.tests.engine.harness import Config, Result, run_config

    done: dict[tuple[Config, bool], Result] = {}

    def run(config: Config, http: bool = False) -> Result:
        if (config, http) not in done:
            done[(config, http)] = run_config(tiny_llama, config, engine_logs, http=http)
        return done[(config, http)]

    return run

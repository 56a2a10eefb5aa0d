"""kvcore-sglang's tests need real SGLang 0.5.19, which lives in .venv-sglang (``./dev test`` runs them there).

In an environment without SGLang (kvcore's own .venv) nothing here is collected, so
a plain ``pytest`` from the repository root neither fails nor runs them twice.
"""

import importlib.util

import pytest

collect_ignore_glob = [] if importlib.util.find_spec("sglang") is not None else ["test_*.py"]


@pytest.fixture
def sglang_request_path(monkeypatch):
    """What SGLang's request path needs on a CPU: the scheduler's ServerArgs published, the CPU kernels in."""
    from sglang.srt.runtime_context import get_context

    from tools.sglang_request_path_shim import install_cpu_kernels

    install_cpu_kernels(monkeypatch)
    # A scheduler process runs with its ServerArgs published; SGLang's request path reads them.
    with get_context().override_server_args():
        yield

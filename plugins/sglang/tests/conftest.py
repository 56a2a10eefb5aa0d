"""kvcore-sglang's tests need real SGLang 0.5.19, which lives in .venv-sglang (``./dev test`` runs them there).

In an environment without SGLang (kvcore's own .venv) nothing here is collected, so
a plain ``pytest`` from the repository root neither fails nor runs them twice.
"""

import importlib.metadata
import importlib.util
import re

import pytest

collect_ignore_glob = [] if importlib.util.find_spec("sglang") is not None else ["test_*.py"]


def _sglang_release() -> str | None:
    """The installed SGLang's release (``0.5.23`` of ``0.5.23.post1``), None without SGLang."""
    try:
        installed = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None
    found = re.match(r"\d+\.\d+\.\d+", installed)
    return found.group(0) if found else installed


# Each SGLang venv runs the tests of its own release's contract module: test_v0_5_23_* need
# SGLang 0.5.23; these drive SGLang 0.5.19's request path or its contract module.
_SGLANG_0_5_19_ONLY = [
    "test_fill_ids.py",
    # SGLang 0.5.23's host pools take other arguments (device_capacity_tokens, start_layer, end_layer).
    "test_hicache_storage.py",
    "test_insert_differential.py",
    "test_mamba_request_path_differential.py",
    "test_registration.py",
    "test_request_path_differential.py",
    "test_swa_request_path_differential.py",
    "test_unified_swa_request_path_differential.py",
]
if _sglang_release() == "0.5.23":
    collect_ignore_glob += _SGLANG_0_5_19_ONLY
elif _sglang_release() is not None:
    collect_ignore_glob += ["test_v0_5_23_*.py"]


@pytest.fixture
def sglang_request_path(monkeypatch):
    """What SGLang's request path needs on a CPU: the scheduler's ServerArgs published, the CPU kernels in."""
    from sglang.srt.runtime_context import get_context

    from tools.sglang_request_path_shim import install_cpu_kernels

    install_cpu_kernels(monkeypatch)
    # A scheduler process runs with its ServerArgs published; SGLang's request path reads them.
    with get_context().override_server_args():
        yield

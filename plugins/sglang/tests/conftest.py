"""kvcore-sglang's tests need real SGLang 0.5.19, which lives in .venv-sglang (``./dev test`` runs them there).

In an environment without SGLang (kvcore's own .venv) nothing here is collected, so
a plain ``pytest`` from the repository root neither fails nor runs them twice.
"""

import importlib.util

collect_ignore_glob = [] if importlib.util.find_spec("sglang") is not None else ["test_*.py"]

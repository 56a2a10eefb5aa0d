"""The examples run, and say what they should."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import kvcore

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _run(name: str) -> str:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / name)], capture_output=True, text=True, timeout=120, env=dict(os.environ)
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_engine_example():
    if "radix" not in kvcore.available_backends():
        pytest.skip("the radix backend (kvcore-radix) is not installed")
    out = _run("engine.py")
    hits = {m[0]: (int(m[1]), int(m[2])) for m in re.findall(r"^(\w+): prompt +(\d+) tokens, +(\d+) from", out, re.M)}
    # (prompt tokens, tokens that came from the cache or the session)
    assert hits == {
        "a": (200, 0),  # the first request computes everything
        "b": (185, 160),  # the system prompt: a's prompt entered the tree when its prefill completed
        "c": (250, 160),
        "d": (263, 240),  # c's prompt and decoded tokens, in whole pages
        "t1": (190, 160),
        "t2": (215, 195),  # all of turn one, through the session
    }
    assert "0 locked, 0 held by requests" in out
    assert out.rstrip().endswith("invariants hold: every slot is back")

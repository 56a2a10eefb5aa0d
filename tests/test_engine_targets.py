"""The ``kvcore_engine_targets`` hook: an integration's names for kvcore backends, listed by ``kvcore backends``.

A throwaway integration answers with one target the engine would build and one it would
refuse; a second one's hook raises.  ``kvcore backends`` lists both targets (the refused
one with why), lists the broken integration under ``failed:``, and exits 1 naming both.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvcore.commands.errors import EXIT_RUNTIME
from kvcore.engine_targets import EngineTarget, engine_targets
from kvcore.plugins import reset_plugins
from kvcore.testing.distributions import make_dist

TOY = '''
import kvcore
from kvcore.engine_targets import EngineTarget

@kvcore.hookimpl
def kvcore_engine_targets():
    return [EngineTarget("toy-ok", "toyengine", "radix", "toy-engine", ("full",), "fine"),
            EngineTarget("toy-bad", "toyengine", "radix", "toy-engine", ("full",), "refused",
                         problem="its builder 'toy:gone' is not there")]
'''

BROKEN = '''
import kvcore

@kvcore.hookimpl
def kvcore_engine_targets():
    return ["not a target"]
'''


@pytest.fixture
def site(tmp_path: Path, monkeypatch):
    make_dist(tmp_path, "toy-engine", "toy_engine", TOY)
    make_dist(tmp_path, "broken-engine", "broken_engine", BROKEN)
    monkeypatch.syspath_prepend(str(tmp_path))
    reset_plugins()
    yield tmp_path
    for name in ("toy_engine", "broken_engine"):
        sys.modules.pop(name, None)
    reset_plugins()


def test_hook_kvcore_engine_targets(site):
    targets, failures = engine_targets()
    found = {t.name: t for t in targets if t.engine == "toyengine"}
    assert found["toy-ok"] == EngineTarget("toy-ok", "toyengine", "radix", "toy-engine", ("full",), "fine")
    assert found["toy-bad"].problem == "its builder 'toy:gone' is not there"
    (broken,) = [f for f in failures if f.distribution == "broken-engine"]
    assert "must return EngineTarget records, got 'not a target'" in broken.error


def test_kvcore_backends_lists_the_targets_and_exits_1_for_a_refused_one(site):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "kvcore", "backends"], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == EXIT_RUNTIME
    assert "toyengine toy-ok -> radix (full; declared by toy-engine)\n" in proc.stdout
    assert "toyengine toy-bad -> radix (full; declared by toy-engine) -- refused: its builder" in proc.stdout
    assert "failed: broken_engine (broken-engine): engine targets failed: TypeError" in proc.stdout
    (line,) = proc.stderr.strip().splitlines()
    assert "1 plugin(s) failed to load: broken_engine" in line
    assert "1 engine target(s) would be refused: toy-bad" in line
    proc = subprocess.run([sys.executable, "-m", "kvcore", "backends", "--json"], capture_output=True, text=True,
                          env=env, timeout=120)
    targets = {t["name"]: t for t in json.loads(proc.stdout)["targets"]}
    assert targets["toy-ok"]["problem"] is None and targets["toy-bad"]["engine"] == "toyengine"

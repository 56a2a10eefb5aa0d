"""``kvcore backends`` lists SGLang's --radix-cache-backend names, each checked as SGLang's build would check it.

A throwaway distribution declares targets in group ``kvcore_sglang.targets``: one good,
one with a builder of its own, and one for each mistake SGLang would otherwise report
only when it starts (a name that differs from its entry point, a builder module or
function that is not there, a hybrid model kind without a builder, a backend that is not
installed).  Each comes back from kvcore's ``kvcore_engine_targets`` hook with the
reason, and ``kvcore backends`` exits 1 naming them.
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from kvcore.plugins import reset_plugins

TOY = '''
from kvcore_sglang.config import Target

def build(target, ctx):
    raise NotImplementedError

GOOD = Target(name="kvcore-toygood", backend="radix", serves=("full",), description="fine")
BUILT = Target(name="kvcore-toybuilt", backend="radix", serves=("full", "hybrid-swa"), description="own builder",
               builder="toy_targets:build")
WRONG = Target(name="kvcore-other", backend="radix", serves=("full",), description="misnamed")
NOMOD = Target(name="kvcore-toynomod", backend="radix", serves=("full",), description="x", builder="no_such_mod:build")
NOFUNC = Target(name="kvcore-toynofunc", backend="radix", serves=("full",), description="x", builder="toy_targets:nope")
HYBRID = Target(name="kvcore-toyhybrid", backend="radix", serves=("full", "hybrid-swa"), description="x")
NOBACKEND = Target(name="kvcore-toyback", backend="no-such-backend", serves=("full",), description="x")
'''

ENTRY_POINTS = {"toygood": "GOOD", "toybuilt": "BUILT", "toywrong": "WRONG", "toynomod": "NOMOD",
                "toynofunc": "NOFUNC", "toyhybrid": "HYBRID", "toyback": "NOBACKEND", "toygone": "MISSING"}


@pytest.fixture
def toy_targets(tmp_path: Path, monkeypatch):
    (tmp_path / "toy_targets.py").write_text(textwrap.dedent(TOY))
    info = tmp_path / "toy_targets-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-targets\nVersion: 1.0\n")
    lines = [f"{ep} = toy_targets:{attr}" for ep, attr in ENTRY_POINTS.items()]
    (info / "entry_points.txt").write_text("[kvcore_sglang.targets]\n" + "\n".join(lines) + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("toy_targets", None)
    reset_plugins()
    yield
    sys.modules.pop("toy_targets", None)
    reset_plugins()


def _by_name() -> dict:
    from kvcore_sglang.target_checks import kvcore_engine_targets

    return {t.name: t for t in kvcore_engine_targets()}


def test_every_target_is_listed_with_what_sglang_would_refuse(toy_targets):
    found = _by_name()
    for own in ("kvcore-radix", "kvcore-swa", "kvcore-mamba", "kvcore-unified", "kvcore-chunk"):
        assert found[own].problem is None and found[own].declared_by == "kvcore-sglang"
    assert found["kvcore-toygood"].problem is None and found["kvcore-toygood"].declared_by == "toy-targets"
    assert found["kvcore-toybuilt"].problem is None  # a builder of its own may serve hybrid models
    expected = {
        "kvcore-toywrong": "must name a kvcore_sglang.Target with name='kvcore-toywrong'",
        "kvcore-toygone": "does not load: AttributeError",
        "kvcore-toynomod": "no module 'no_such_mod' is installed",
        "kvcore-toynofunc": "defines no 'nope'",
        "kvcore-toyhybrid": "serves hybrid-swa, but without a builder of its own it is built as kvcore-radix is",
        "kvcore-toyback": "kvcore backend 'no-such-backend' is not installed",
    }
    for name, why in expected.items():
        assert found[name].problem is not None and why in found[name].problem, (name, found[name].problem)


def test_kvcore_backends_lists_the_targets_and_exits_1_naming_the_refused(toy_targets, capsys):
    from kvcore.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["backends", "--json"])
    assert exc.value.code == 1
    out = capsys.readouterr()
    targets = {t["name"]: t for t in json.loads(out.out)["targets"]}
    assert targets["kvcore-swa"]["backend"] == "swa" and targets["kvcore-swa"]["problem"] is None
    assert "defines no 'nope'" in targets["kvcore-toynofunc"]["problem"]
    (line,) = out.err.strip().splitlines()
    assert "6 engine target(s) would be refused" in line and "kvcore-toywrong" in line


def test_the_shipped_targets_are_all_buildable(capsys):
    """Without the throwaway distribution every installed name checks out (the listing exits 0)."""
    reset_plugins()
    assert all(t.problem is None for t in _by_name().values())

"""Meta-tests of the hook specification (as datasette checks its own): every hook is
named by the rules, documented, and exercised by a test named ``test_hook_<name>``."""

import inspect
import re
from pathlib import Path

import pytest

from kvcore import hookspecs

ROOT = Path(__file__).resolve().parents[1]
LIFECYCLE = {"cache_finished_req", "cache_unfinished_req"}


def _hooks() -> dict[str, object]:
    marker = f"{hookspecs.PROJECT_NAME}_spec"
    found = {name: fn for name, fn in vars(hookspecs).items() if callable(fn) and hasattr(fn, marker)}
    found.update(
        (name, fn) for name, fn in vars(hookspecs.CacheLifecycleSpec).items() if callable(fn) and hasattr(fn, marker)
    )
    return found


def _test_sources() -> str:
    files = list((ROOT / "tests").glob("test_*.py")) + list((ROOT / "plugins").glob("*/tests/test_*.py"))
    return "\n".join(f.read_text() for f in files)


def test_the_hookspecs_are_found():
    assert {"kvcore_register_backends", "kvcore_cache_created", *LIFECYCLE} <= set(_hooks())


@pytest.mark.parametrize("name", sorted(_hooks()))
def test_hook_is_named_by_the_rules(name):
    assert name.startswith("kvcore_") or name in LIFECYCLE, f"hook {name!r} must start with 'kvcore_'"


@pytest.mark.parametrize("name", sorted(_hooks()))
def test_hook_is_documented(name):
    doc = inspect.getdoc(_hooks()[name]) or ""
    assert len(doc) > 40, f"hook {name!r} has no real docstring"
    # Say what the hook returns and whether the first result wins.
    assert re.search(r"return|ignored", doc), f"hook {name!r}: its docstring must say what it returns"
    assert re.search(r"first result wins|[Ee]very implementation is called", doc), (
        f"hook {name!r}: its docstring must say whether the first result wins"
    )


@pytest.mark.parametrize("name", sorted(_hooks()))
def test_hook_has_a_test(name):
    assert f"def test_hook_{name}(" in _test_sources(), f"hook {name!r} has no test named test_hook_{name}"


def test_hooks_are_documented_in_the_readme():
    readme = (ROOT / "README.md").read_text()
    missing = [name for name in _hooks() if name not in readme]
    assert not missing, f"README.md does not mention hooks {missing}"

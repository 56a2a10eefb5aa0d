"""The author's guide covers the protocol and everything its example uses (a meta-test, as datasette's)."""

import ast
import inspect
from pathlib import Path

import pytest

import kvcore

ROOT = Path(__file__).resolve().parents[1]
GUIDE = (ROOT / "docs" / "writing-a-backend.md").read_text()
EXAMPLE = ROOT / "examples" / "kvcore-example-backend"


def test_the_readme_links_the_guide():
    readme = (ROOT / "README.md").read_text()
    assert "(docs/writing-a-backend.md)" in readme and "examples/kvcore-example-backend" in readme


@pytest.mark.parametrize("method", sorted(kvcore.BasePrefixCache.__abstractmethods__))
def test_every_abstract_method_is_in_the_guide(method):
    assert f"**`{method}(" in GUIDE, f"the guide does not describe abstract method {method}"


@pytest.mark.parametrize(
    "method",
    sorted(n for n, f in vars(kvcore.BasePrefixCache).items()
           if inspect.isfunction(f) and not n.startswith("_") and n not in kvcore.BasePrefixCache.__abstractmethods__),
)
def test_every_other_method_is_named_in_the_guide(method):
    assert f"`{method}" in GUIDE, f"the guide does not name BasePrefixCache.{method}"


def _kvcore_names_the_example_imports() -> set[str]:
    names = set()
    for path in (EXAMPLE / "kvcore_example").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvcore") \
                    and not (node.module or "").startswith("kvcore_example"):
                names.update(a.name for a in node.names)
    return names


def test_the_guide_names_everything_the_example_imports():
    names = _kvcore_names_the_example_imports()
    assert {"BasePrefixCache", "Node", "descend", "split_node"} <= names  # the walk found the imports
    missing = sorted(n for n in names if n not in GUIDE)
    assert not missing, f"the example uses {missing}, which the guide never names"


def test_the_example_is_a_full_distribution():
    for part in ("pyproject.toml", "README.md", "kvcore_example/__init__.py", "kvcore_example/py.typed",
                 "tests/test_conformance.py"):
        assert (EXAMPLE / part).is_file(), part
    assert 'example = "kvcore_example.plugin"' in (EXAMPLE / "pyproject.toml").read_text()

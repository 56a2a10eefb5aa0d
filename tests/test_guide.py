"""The author's guide covers the protocol and everything its example uses (a meta-test, as datasette's)."""

import ast
import inspect
from pathlib import Path

import pytest

import kvcore

ROOT = Path(__file__).resolve().parents[1]
GUIDE = (ROOT / "docs" / "writing-a-backend.md").read_text()
EXAMPLE = ROOT / "examples" / "kvcore-example-backend"
COMPONENT_EXAMPLE = ROOT / "examples" / "kvcore-example-component"


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


def _kvcore_names_imported(package: Path) -> set[str]:
    names = set()
    for path in package.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvcore") \
                    and not (node.module or "").startswith(package.name):
                names.update(a.name for a in node.names)
    return names


def test_the_guide_names_everything_the_example_imports():
    names = _kvcore_names_imported(EXAMPLE / "kvcore_example")
    assert {"BasePrefixCache", "Node", "descend", "split_node"} <= names  # the walk found the imports
    missing = sorted(n for n in names if n not in GUIDE)
    assert not missing, f"the example uses {missing}, which the guide never names"


def test_the_guide_names_everything_the_component_example_imports():
    names = _kvcore_names_imported(COMPONENT_EXAMPLE / "kvcore_example_component")
    assert {"LRUValueComponent", "UnifiedConfig", "UnifiedRadixCache", "hookimpl"} <= names
    missing = sorted(n for n in names if n not in GUIDE)
    assert not missing, f"the component example uses {missing}, which the guide never names"


@pytest.mark.parametrize("example, package, entry", [
    (EXAMPLE, "kvcore_example", 'example = "kvcore_example.plugin"'),
    (COMPONENT_EXAMPLE, "kvcore_example_component", 'example-component = "kvcore_example_component.plugin"'),
])
def test_the_example_is_a_full_distribution(example, package, entry):
    for part in ("pyproject.toml", "README.md", f"{package}/__init__.py", f"{package}/py.typed",
                 "tests/test_conformance.py"):
        assert (example / part).is_file(), part
    assert entry in (example / "pyproject.toml").read_text()


def test_the_guide_says_to_install_the_test_extra():
    # Old: never said, and the kit then failed on `import pytest`.
    assert 'pip install "kvcore[test]"' in GUIDE
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'test = ["pytest' in pyproject and "hypothesis" in pyproject.split("test = ", 1)[1].splitlines()[0]


@pytest.mark.parametrize("name", ["checked_value", "checked_key"])
def test_the_guide_gives_the_tree_checks_their_real_signatures(name):
    # Old: `checked_value` was given without its lengths and `device`.
    import kvcore.tree

    params = ", ".join(inspect.signature(getattr(kvcore.tree, name)).parameters)
    assert f"`{name}({params})`" in GUIDE, f"the guide does not write {name}({params})"


def test_the_guide_answers_what_an_author_asked():
    for needle in ("last_access_time", "hit_count", "time.monotonic()", "itertools.count(1)",  # who bumps, which clock
                   "**A disabled cache**", "InsertResult(0, root)", "`cache_unfinished_req` returns at once",
                   "a node keeps no view of it", "eviction_policies", "--page-size N"):
        assert needle in GUIDE, needle


def test_what_the_guide_says_of_a_disabled_insert_and_the_clock_is_what_the_code_does():
    import time

    import torch

    import kvcore.tree

    radix = pytest.importorskip("kvcore_radix")
    assert radix.RadixCache.clock is time.monotonic
    cache = kvcore.create_cache("radix", size=64, max_num_reqs=4, max_context_len=32, disable=True)
    value = cache.token_to_kv_pool_allocator.alloc(4)
    result = cache.insert([1, 2, 3, 4], value)
    assert result.prefix_len == 0 and result.last_device_node is cache.root_node
    with pytest.raises(ValueError):
        cache.insert([1, 2, 3, 4], value[:2])  # the value's length is still checked
    assert cache.total_size() == 0
    cache.token_to_kv_pool_allocator.free(value)  # every slot stayed the caller's
    kvcore.InvariantChecker(cache).check([])
    assert kvcore.tree.checked_value(value, 4, 4, value.device) is value  # no copy: a node clones what it keeps
    row = torch.tensor([5, 6, 7, 8], dtype=torch.int32)  # a request's row is int32: converted, a new tensor
    assert kvcore.tree.checked_value(row, 4, 4, torch.device("cpu")).data_ptr() != row.data_ptr()

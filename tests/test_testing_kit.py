"""The conformance kit as an author runs it: its fuzz test finds what `kvcore fuzz` finds, and pytest
rewrites its asserts (the pytest11 entry point), so a failure shows its values."""

from __future__ import annotations

from importlib import metadata

import pytest

import kvcore
from kvcore.plugins import BACKENDS, get_backend, get_plugin_manager
from kvcore.testing import PrefixCacheConformance


def test_the_kit_is_registered_for_assertion_rewriting():
    (ep,) = [e for e in metadata.entry_points(group="pytest11") if e.name == "kvcore"]
    assert ep.value == "kvcore.pytest_plugin"
    import kvcore.testing.conformance as conformance
    import kvcore.testing.helpers as helpers

    # pytest's rewriter puts its helper module into every module it rewrites.
    assert "@pytest_ar" in vars(conformance) and "@pytest_ar" in vars(helpers)


def test_a_kit_assertion_shows_its_values():
    """A failing kit test says what it compared, not a bare AssertionError."""
    cache = kvcore.create_cache("chunk", size=16, max_num_reqs=2, max_context_len=16)
    with pytest.raises(AssertionError) as err:
        PrefixCacheConformance().test_pools_exposed(lambda: cache, 16)
    assert "assert 1 == 16" in str(err.value)
    kvcore.InvariantChecker(cache).check([])


def _register(name, cls):
    class Plugin:
        @kvcore.hookimpl
        def kvcore_register_backends(self, register):
            register(name, cls, config=get_backend("radix").config)

    get_plugin_manager().register(Plugin(), name=f"{name}-plugin")
    BACKENDS.reset()


@pytest.fixture
def radix_class():
    """kvcore-radix's class, to make buggy backends from (an author subclassing a published class); they
    are unregistered after.  The registered factory wraps it (``kvcore.tiers.tiered``), so the class is
    taken from the package, as an author would."""
    radix = pytest.importorskip("kvcore_radix")
    names: list[str] = []
    yield radix.RadixCache, names
    for name in names:
        get_plugin_manager().unregister(name=f"{name}-plugin")
    BACKENDS.reset()


def _kit_fuzz_failure(name: str) -> str:
    class TestIt(PrefixCacheConformance):
        backend = name

    with pytest.raises(pytest.fail.Exception) as err:
        TestIt().test_fuzz(page_size=1)
    return str(err.value)


def test_the_kits_fuzz_test_finds_an_unclean_error(radix_class):
    base, names = radix_class

    class Careless(base):  # type: ignore[misc, valid-type]
        def dec_lock_ref(self, node, lock=None):
            if node.lock_ref <= 0:  # AttributeError on a foreign object: the bug the fuzz finds
                raise ValueError("not locked")
            return super().dec_lock_ref(node, lock)

    _register("careless", Careless)
    names.append("careless")
    message = _kit_fuzz_failure("careless")
    assert "fuzz failure: backend careless, seed 0" in message
    assert "bad input 'dec_lock_ref foreign node' raised AttributeError" in message
    assert "replay: kvcore fuzz --backend careless" in message


def test_the_kits_fuzz_test_finds_ignored_slot_claims(radix_class):
    base, names = radix_class

    class Trusting(base):  # type: ignore[misc, valid-type]
        def __init__(self, params):
            super().__init__(params)
            self.strict = False  # the bug: strict slot claims ignored whatever the option says

    _register("trusting", Trusting)
    names.append("trusting")
    message = _kit_fuzz_failure("trusting")
    assert "fuzz failure: backend trusting" in message
    assert "' was accepted" in message, message  # a slot claim the tree should have refused


def test_the_kits_fuzz_test_passes_a_sound_backend():
    class TestChunk(PrefixCacheConformance):
        backend = "chunk"
        fuzz_ops = 500

    TestChunk().test_fuzz(page_size=1)


def _kit_eviction_failure(name: str) -> str:
    class TestIt(PrefixCacheConformance):
        backend = name
        supports_prefix_reuse = True

    def build():
        return kvcore.create_cache(name, size=64, page_size=1, max_num_reqs=8, max_context_len=64)

    with pytest.raises((AssertionError, pytest.fail.Exception)) as err:
        TestIt().test_evicted_node_is_detached_and_refuses_locks(build, 1)
    return str(err.value)


def test_the_kit_finds_an_evicted_node_that_keeps_its_parent(radix_class):
    # Old: passed the kit and the fuzz; a lock on it then walked up a tree it had left.
    from kvcore.tree import iter_subtree

    base, names = radix_class

    class Clinging(base):  # type: ignore[misc, valid-type]
        def evict(self, num_tokens):
            parents = {id(x): (x, x.parent) for x in iter_subtree(self.root_node)}
            result = super().evict(num_tokens)
            for x, parent in parents.values():
                if x.parent is None and parent is not None:
                    x.parent = parent  # the bug: the evicted node keeps its link
            return result

    _register("clinging", Clinging)
    names.append("clinging")
    assert "an evicted node keeps its parent link" in _kit_eviction_failure("clinging")


def test_the_kit_finds_a_lock_taken_on_an_evicted_node(radix_class):
    from kvcore.cache import LockResult

    base, names = radix_class

    class Lenient(base):  # type: ignore[misc, valid-type]
        def inc_lock_ref(self, node):
            if node.parent is None and node is not self.root_node:
                return LockResult(0)  # the bug: an evicted node is "locked" without a word
            return super().inc_lock_ref(node)

    _register("lenient", Lenient)
    names.append("lenient")
    assert "DID NOT RAISE" in _kit_eviction_failure("lenient")

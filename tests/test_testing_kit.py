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


@pytest.fixture
def careless_backend():
    """A radix tree whose dec_lock_ref reads node.lock_ref before checking the node is its own."""
    base = get_backend("radix").factory if "radix" in BACKENDS.all() else None
    if base is None:
        pytest.skip("kvcore-radix is not installed")

    class Careless(base):  # type: ignore[misc, valid-type]
        def dec_lock_ref(self, node, lock=None):
            if node.lock_ref <= 0:  # AttributeError on a foreign object: the bug the fuzz finds
                raise ValueError("not locked")
            return super().dec_lock_ref(node, lock)

    class Plugin:
        @kvcore.hookimpl
        def kvcore_register_backends(self, register):
            register("careless", Careless, config=get_backend("radix").config)

    pm = get_plugin_manager()
    pm.register(Plugin(), name="careless-plugin")
    BACKENDS.reset()
    yield "careless"
    pm.unregister(name="careless-plugin")
    BACKENDS.reset()


def test_the_kits_fuzz_test_finds_an_unclean_error(careless_backend):
    class TestCareless(PrefixCacheConformance):
        backend = careless_backend

    with pytest.raises(pytest.fail.Exception) as err:
        TestCareless().test_fuzz(page_size=1)
    message = str(err.value)
    assert "fuzz failure: backend careless, seed 0" in message
    assert "bad input 'dec_lock_ref foreign node' raised AttributeError" in message
    assert "replay: kvcore fuzz --backend careless" in message


def test_the_kits_fuzz_test_passes_a_sound_backend():
    class TestChunk(PrefixCacheConformance):
        backend = "chunk"
        fuzz_ops = 500

    TestChunk().test_fuzz(page_size=1)

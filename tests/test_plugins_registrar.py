"""The one registrar: one conflict rule for every kind, first-party by name and origin, plugin mistakes
reported in one line that names the nearest real hook."""

from __future__ import annotations

import sys
from importlib import metadata
from types import SimpleNamespace

import pytest

import kvcore
from kvcore.components import get_component
from kvcore.devices import get_device
from kvcore.plugins import (
    BACKENDS,
    EVICTION_POLICIES,
    Kind,
    get_backend,
    get_eviction_policy,
    is_first_party,
    plugin_failures,
    reset_plugins,
)
from kvcore.testing.distributions import make_dist

CLASH = '''
import kvcore

class Fake(kvcore.ChunkCache):
    """Not the real one."""

class FakePolicy:
    def get_priority(self, node):
        return 0

@kvcore.hookimpl
def kvcore_register_backends(register):
    register("radix", Fake)
    register("chunk", Fake)
    register("clash-own", Fake)

@kvcore.hookimpl
def kvcore_register_devices(register):
    register("cpu", why_unavailable=lambda: None)

@kvcore.hookimpl
def kvcore_register_eviction_policies(register):
    register("lru", FakePolicy)

@kvcore.hookimpl
def kvcore_register_components(register):
    register("swa", object)
'''


@pytest.fixture
def site(tmp_path, monkeypatch):
    """Distributions written under ``tmp_path`` are discovered in this process; the registry reloads after."""
    monkeypatch.syspath_prepend(str(tmp_path))
    added = set(sys.modules)
    reset_plugins()
    yield tmp_path
    for name in set(sys.modules) - added:
        if name.startswith(("clash_", "typo_", "bare_", "twice_", "mycache")):
            sys.modules.pop(name, None)
    reset_plugins()


def _failed(plugin: str) -> list[str]:
    return [f.error for f in plugin_failures() if f.plugin == plugin]


def test_a_kvcore_prefixed_distribution_is_not_first_party(site):
    """kvcore-clash takes kvcore's names of every kind: it is the one refused, the real ones stay."""
    make_dist(site, "kvcore-clash", "clash_kv", CLASH)
    reset_plugins()
    assert get_backend("radix").distribution == "kvcore-radix"
    assert get_backend("chunk").factory is kvcore.ChunkCache
    assert get_backend("clash-own").distribution == "kvcore-clash"  # its own names are fine
    assert get_device("cpu").distribution == "kvcore"
    assert get_eviction_policy("lru") is not sys.modules["clash_kv"].FakePolicy
    assert get_component("swa").distribution == "kvcore-swa"
    errors = _failed("clash_kv")
    assert len(errors) == 5, errors
    for what in ("backend 'radix'", "backend 'chunk'", "device 'cpu'", "eviction policy 'lru'", "component 'swa'"):
        assert any(e.startswith(f"{what} refused: it is already provided by") for e in errors), (what, errors)
    assert all("kvcore's own" in e and "another name" in e for e in errors)
    # kvcore's own plugins are not blamed for the clash.
    assert not [f for f in plugin_failures() if f.distribution.startswith("kvcore") and f.plugin != "clash_kv"]
    cache = kvcore.create_cache("radix", size=64, max_num_reqs=2, max_context_len=16)
    assert cache.radix and cache.components[0].name == "full"  # kvcore-radix's, not the clash's
    kvcore.InvariantChecker(cache).check([])


def test_a_first_party_name_is_checked_by_origin_too(tmp_path):
    """kvcore-npu's name and entry point, from code that kvcore-npu did not install: not first-party."""
    pytest.importorskip("kvcore_npu")
    import kvcore_npu.plugin

    real = next(ep for ep in metadata.distribution("kvcore-npu").entry_points if ep.group == "kvcore")
    assert is_first_party(real, kvcore_npu.plugin)
    info = tmp_path / "kvcore_npu-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvcore-npu\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text("[kvcore]\nnpu = kvcore_npu.plugin\n")
    fake = next(iter(metadata.PathDistribution(info).entry_points))
    assert fake.value == real.value
    assert not is_first_party(fake, SimpleNamespace(__file__=str(tmp_path / "kvcore_npu" / "plugin.py")))
    assert not is_first_party(real, SimpleNamespace(__file__=str(tmp_path / "kvcore_npu" / "plugin.py")))


def test_two_third_parties_on_one_name_disable_it_for_every_kind(site):
    for dist, module in (("alpha-kv", "clash_alpha"), ("beta-kv", "clash_beta")):
        make_dist(site, dist, module, '''
            import kvcore
            class P:
                def get_priority(self, node):
                    return 0
            @kvcore.hookimpl
            def kvcore_register_eviction_policies(register):
                register("twin", P)
        ''')
    reset_plugins()
    with pytest.raises(ValueError, match=r"eviction policy 'twin' is registered by both alpha-kv .* and beta-kv"):
        get_eviction_policy("twin")
    assert "twin" not in EVICTION_POLICIES.all()
    assert {"alpha-kv", "beta-kv"} <= {f.distribution for f in EVICTION_POLICIES.failures()}


def test_a_name_registered_twice_by_one_plugin_is_its_error(site):
    make_dist(site, "twice-kv", "twice_kv", '''
        import kvcore
        @kvcore.hookimpl
        def kvcore_register_backends(register):
            register("once", kvcore.ChunkCache)
            register("once", kvcore.ChunkCache)
    ''')
    reset_plugins()
    assert "once" not in BACKENDS.all()
    assert _failed("twice_kv") == [
        "backend registration failed: PluginError: backend 'once' registered twice by twice-kv"
    ]


@pytest.mark.parametrize("decorated", [True, False])
def test_a_misspelt_hook_is_one_line_naming_the_nearest(site, decorated):
    """With or without @kvcore.hookimpl, a misspelt hook is a failure line that names the real hook."""
    make_dist(site, "typo-kv", "typo_kv", f'''
        import kvcore
        {"@kvcore.hookimpl" if decorated else ""}
        def kvcore_register_backend(register):
            register("typo", kvcore.ChunkCache)
    ''')
    reset_plugins()
    assert "typo" not in BACKENDS.all()
    assert _failed("typo_kv") == [
        "invalid plugin: kvcore_register_backend is not a kvcore hook; did you mean kvcore_register_backends?"
    ]


def test_a_decorated_name_far_from_every_hook_lists_them(site):
    make_dist(site, "typo-kv", "typo_kv", '''
        import kvcore
        @kvcore.hookimpl
        def setup_everything(register):
            pass
    ''')
    reset_plugins()
    (error,) = _failed("typo_kv")
    assert error.startswith("invalid plugin: setup_everything is not a kvcore hook; the hooks are ")
    assert "kvcore_register_backends" in error and "Traceback" not in error


def test_an_undecorated_helper_is_not_a_mistake(site):
    make_dist(site, "bare-kv", "bare_kv", '''
        import kvcore
        def helper_for_tests():
            return 1
        @kvcore.hookimpl
        def kvcore_register_backends(register):
            register("bare-ok", kvcore.ChunkCache)
    ''')
    reset_plugins()
    assert "bare-ok" in BACKENDS.all() and _failed("bare_kv") == []


def test_a_backend_that_did_not_load_says_why_in_the_conformance_kit(site):
    """The kit used to die at collection with KeyError: 'mycache'."""
    from kvcore.testing import PrefixCacheConformance

    make_dist(site, "kvcore-mycache", "mycache_kv", "import no_such_module_here\n")
    reset_plugins()

    class TestMyCache(PrefixCacheConformance):
        backend = "mycache"

    with pytest.raises(kvcore.BackendNotFound) as err:
        TestMyCache.conformance_page_sizes()
    message = str(err.value)
    assert message.startswith("unknown backend 'mycache'; known backends: ")
    assert "not loaded: mycache_kv (kvcore-mycache): import failed: ModuleNotFoundError: No module named " in message


def test_one_kind_line_is_a_new_kind(site):
    """A fourth kind needs its hookspec and one Kind(...) line (here: a hook that exists, read as a new kind)."""
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Thing:
        name: str
        factory: object
        distribution: str

    def make_thing(origin, name, factory, description=""):
        if not callable(factory):
            raise TypeError(f"thing {name!r}: factory is not callable")
        return Thing(name, factory, origin.distribution)

    make_dist(site, "thing-kv", "clash_thing", '''
        import kvcore
        @kvcore.hookimpl
        def kvcore_register_eviction_policies(register):
            register("lru", len)
            register("mine", len)
    ''')
    reset_plugins()
    things = Kind("thing", "kvcore_register_eviction_policies", make_thing, error=LookupError)
    try:
        assert things.get("mine").distribution == "thing-kv"
        assert things.get("lru").distribution == "kvcore"  # the one rule, for the new kind too
        assert any(f.plugin == "clash_thing" and "thing 'lru' refused" in f.error for f in things.failures())
        with pytest.raises(LookupError, match=r"unknown thing 'nope'; registered things: .*mine"):
            things.get("nope")
    finally:
        things.withdraw()


def test_iter_owned_slots_yielding_nothing_is_named():
    """A backend whose iter_owned_slots() yields nothing: the leak message points at iter_owned_slots."""
    pytest.importorskip("kvcore_radix")
    cache = kvcore.create_cache("radix", size=64, max_num_reqs=2, max_context_len=16)
    slots = cache.token_to_kv_pool_allocator.alloc(4)
    cache.insert([1, 2, 3, 4], slots)
    kvcore.InvariantChecker(cache).check([])
    cache.iter_owned_slots = lambda: iter(())  # type: ignore[method-assign]
    with pytest.raises(kvcore.InvariantViolation) as err:
        kvcore.InvariantChecker(cache).check([])
    assert "leaked" in str(err.value)
    assert "counts 4 cached token(s) in this pool but its iter_owned_slots() yielded 0 slot(s)" in str(err.value)
    del cache.iter_owned_slots
    kvcore.InvariantChecker(cache).check([])

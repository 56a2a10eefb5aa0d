"""Capabilities: what a cache does beyond the core calls is declared, checked once when built, and reached typed.

Each installed backend's declaration is pinned here; a declaration without its calls
is refused by ``create_cache`` naming them; the base class holds none of the
capabilities' calls (so nothing answers "no window" for a cache that never said so);
and a chunk cache without a window is never asked to free one.
"""

from __future__ import annotations

import inspect

import pytest

import kvcore
from kvcore import BasePrefixCache, Capability, ChunkCache, InvariantChecker
from kvcore.capabilities import (
    PROTOCOL_CALLS,
    SparseCache,
    StatefulCache,
    WindowedCache,
    WindowLockRelease,
    check_declared,
    sparse,
    stateful,
    window_lock_release,
    windowed,
)
from kvcore.components import available_components
from kvcore.plugins import reset_plugins
from kvcore.testing import admit, decode, finish, make_req, prefill
from kvcore.testing.distributions import make_dist

INSTALLED = set(kvcore.available_backends())
W, L, S, R, E = (Capability.WINDOWED, Capability.WINDOW_LOCK_RELEASE, Capability.REQUEST_STATE,
                 Capability.SPARSE, Capability.EVICTION_REPORTS)

# What each first-party backend declares (the unified tree: evictions reported, plus its components').
DECLARED = {
    "chunk": set(),
    "radix": {E},
    "unified": {E},
    "swa": {E, W, L},
    "unified-swa": {E, W, L},
    "mamba": {E, S},
    "unified-mamba": {E, S},
    "swa-chunk": {W, L},
    "swa-pure-chunk": {W, L},
    "swa-pure": {W},
    "hisparse": {R},
    "npu": {E},
}

SMALL = {"size": 256, "max_num_reqs": 4, "max_context_len": 64}


@pytest.mark.parametrize("backend", sorted(set(DECLARED) & INSTALLED))
def test_each_backend_declares_what_it_does(backend: str) -> None:
    try:
        cache = kvcore.create_cache(backend)
    except kvcore.DeviceUnavailable:
        pytest.skip(f"{backend}: its device is not here")
    assert cache.capabilities == frozenset(DECLARED[backend])
    views = {W: windowed(cache), L: window_lock_release(cache), S: stateful(cache), R: sparse(cache)}
    for cap, view in views.items():
        assert (view is cache) == (cap in cache.capabilities), f"{backend}: accessor of {cap.name}"


def test_a_component_set_declares_the_union_of_its_components() -> None:
    if not {"swa", "mamba"} <= set(available_components()):
        pytest.skip("kvcore-swa or kvcore-mamba absent")
    cache = kvcore.create_cache("unified", components=("full", "swa", "mamba"), sliding_window_size=8)
    assert cache.capabilities == frozenset({E, W, L, S})


def test_the_base_class_holds_no_capability_call() -> None:
    calls = {name for names in PROTOCOL_CALLS.values() for name in names}
    assert not calls & set(dir(BasePrefixCache)), "a capability's call has a default on BasePrefixCache"


@pytest.mark.parametrize("protocol, cap", [(WindowedCache, W), (WindowLockRelease, L), (StatefulCache, S),
                                           (SparseCache, R)])
def test_the_table_lists_each_protocols_calls(protocol: type, cap: Capability) -> None:
    members = {n for n, v in vars(protocol).items() if not n.startswith("_") and inspect.isfunction(v)}
    assert members == set(PROTOCOL_CALLS[cap])


class _Declares(ChunkCache):
    capabilities = frozenset({Capability.WINDOWED, Capability.SPARSE})

    def sparse_top_k(self) -> int:
        return 1


def test_a_declaration_without_its_calls_is_refused_naming_them() -> None:
    cache = _Declares.__new__(_Declares)
    with pytest.raises(TypeError, match=r"backend 'demo' \(_Declares\) declares capabilities without their calls "
                                        r"\(SPARSE: on_decode_step, WINDOWED: free_window_slots\)"):
        check_declared(cache, "demo")


def test_a_declaration_that_is_not_a_set_of_capabilities_is_refused() -> None:
    cache = ChunkCache.__new__(ChunkCache)
    cache.capabilities = {"windowed"}  # type: ignore[assignment]
    with pytest.raises(TypeError, match=r"backend 'demo': capabilities must be a frozenset of kvcore.Capability"):
        check_declared(cache, "demo")


HALF_DECLARED = '''
import kvcore
from kvcore import Capability, ChunkCache


class HalfWindowCache(ChunkCache):
    """Declares a window, frees none."""

    capabilities = frozenset({Capability.WINDOWED})


@kvcore.hookimpl
def kvcore_register_backends(register):
    register("half-window", HalfWindowCache, description="declares a window without its call")
'''


def test_create_cache_refuses_a_backend_whose_declaration_lacks_its_calls(tmp_path, monkeypatch) -> None:
    make_dist(tmp_path, "half-window-kv", "half_window_kv", HALF_DECLARED)
    monkeypatch.syspath_prepend(str(tmp_path))
    reset_plugins()
    try:
        with pytest.raises(TypeError, match=r"'half-window' \(HalfWindowCache\) .* \(WINDOWED: free_window_slots\)"):
            kvcore.create_cache("half-window")
    finally:
        reset_plugins()


def test_a_chunk_cache_without_a_window_is_not_asked_to_free_one() -> None:
    """The engine frees window slots only where the cache declares a window (before, a do-nothing default
    on every cache answered for it)."""
    cache = kvcore.create_cache("chunk", **SMALL)
    assert windowed(cache) is None
    req = make_req("r", list(range(1, 40)))
    assert admit(cache, req)
    assert prefill(cache, req, upto=16)
    assert prefill(cache, req)
    decode(cache, req, 3)
    finish(cache, req)
    InvariantChecker(cache).check(owners=[])


def test_a_wrapper_declares_what_its_backend_declares() -> None:
    backend = "swa" if "swa" in INSTALLED else "radix"
    inner = kvcore.create_cache(backend)
    session = kvcore.StreamingSession(inner)
    assert session.capabilities == inner.capabilities
    assert (windowed(session) is session) == (windowed(inner) is inner)
    InvariantChecker(session).check(owners=[])

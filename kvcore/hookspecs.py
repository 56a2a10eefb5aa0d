"""The hooks kvcore calls, and the markers plugins use to implement them.

Discovery hooks run once, when the plugin manager loads; ``kvcore_cache_created``
runs once per built cache; the two lifecycle hooks (SGLang's names) run once per
finished request and once per prefill chunk.

Why nothing per token goes through pluggy: a hook call costs about 1.5-2 µs on
the machines we measure on, more than a whole ``match_prefix`` of a short key.
A scheduler step calls match, insert, evict, lock refs and allocation many
times per request, so those are plain method calls on the backend, and the
pools are plain objects; pluggy is kept for discovery and for the two
per-request lifecycle calls that extensions (metrics, KV events, write-through
to another tier) need to wrap.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from kvcore.cache import BasePrefixCache
    from kvcore.engine_targets import EngineTarget
    from kvcore.record import Req

PROJECT_NAME = "kvcore"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

__all__ = ["hookspec", "hookimpl", "PROJECT_NAME", "CacheLifecycleSpec"]


@hookspec
def kvcore_register_backends(register: Callable[..., None]) -> None:
    """Register cache backends: ``register(name, factory, config=..., description=..., reference=None,
    pools=None)``.

    ``factory(params)`` receives a :class:`kvcore.CacheInitParams` and returns a
    :class:`kvcore.BasePrefixCache`; ``config`` is the pydantic model of the
    backend's options (default :class:`kvcore.CacheConfig`); ``reference`` names
    the backend that ``kvcore bench`` compares this one against (default
    ``radix``); ``pools`` is the :class:`kvcore.pool_builder.PoolBuilder` that builds
    its pools from the config (default: kvcore's own).  Names follow the registrar's
    one rule (:mod:`kvcore.plugins`): kvcore's own names stay theirs, a name two
    others claim is refused, naming both.  Every implementation is called; the
    return value is ignored.
    """


@hookspec
def kvcore_register_eviction_policies(register: Callable[[str, Callable[[], Any]], None]) -> None:
    """Register eviction policies for tree backends: ``register(name, factory)``.

    ``factory()`` returns an object with ``get_priority(node)``; nodes with the
    smallest priority are evicted first.  A :class:`kvcore.tree.EvictionStrategy`
    subclass may declare ``monotone = True`` (a node's priority never decreases while
    it is in the tree): trees then keep their leaves ordered instead of ranking every
    leaf on each eviction.  Names follow the registrar's one rule
    (:mod:`kvcore.plugins`).  Every implementation is called; the return value is ignored.
    """


@hookspec
def kvcore_register_devices(register: Callable[..., None]) -> None:
    """Register device kinds: ``register(name, *, why_unavailable, resolve=None, allocator=None,
    kv_pool=None, defaults=None, synchronize=None, page_aligned_sessions=False, description="")``.

    ``why_unavailable()`` returns None when the kind is usable here, else why not
    ("torch_npu is not installed"); it runs when devices are listed, so it must not
    import heavy modules.  ``resolve(text)`` returns the ``torch.device`` and does the
    heavy imports.  ``allocator`` and ``kv_pool`` are the classes pools are built
    with on this device, ``defaults`` the :class:`kvcore.CacheConfig` options it sets
    when the caller does not (see :mod:`kvcore.devices`).  The core registers ``cpu``
    and ``cuda`` through this hook; names follow the registrar's one rule
    (:mod:`kvcore.plugins`).  Every implementation is called; the return value is ignored.
    """


@hookspec
def kvcore_register_components(register: Callable[..., None]) -> None:
    """Register tree component kinds for the ``unified`` backend:
    ``register(name, factory, *, options=None, description="")``.

    ``factory(cache, options)`` returns a :class:`kvcore.components.TreeComponent`
    (the module docstring of :mod:`kvcore.components` is the contract: value or
    tombstone per node, lock scope, match validator, insert consumption, eviction
    order, pool accounting); ``options`` is its pydantic options model
    (``extra="forbid"``), whose fields become options of
    ``create_cache("unified", components=(...))``.  ``full``, ``swa`` and ``mamba``
    register through this hook too; names follow the registrar's one rule
    (:mod:`kvcore.plugins`).  Every implementation is called; the return value is ignored.
    """


@hookspec
def kvcore_register_stores(register: Callable[..., None]) -> None:
    """Register KV stores by URL scheme: ``register(scheme, factory, description="")``.

    ``factory(url)`` receives a parsed :class:`kvcore.stores.StoreURL` and returns a
    :class:`kvcore.stores.KVStore`; it raises ``ValueError`` (or
    ``StoreConfigError``) for a malformed URL or option and must not fail because
    the store is unreachable (that store answers misses).  ``kvcore.open_store(url)``
    picks the factory by the URL's scheme; the core registers ``memory`` and
    ``file``; schemes follow the registrar's one rule (:mod:`kvcore.plugins`), as
    every other kind does.  Every implementation is called; the return value is ignored.
    """


@hookspec
def kvcore_engine_targets() -> list[EngineTarget]:
    """The names an engine integration gives kvcore backends, each checked, for ``kvcore backends`` to list.

    The hook returns a list of :class:`kvcore.engine_targets.EngineTarget` (kvcore-sglang: one per
    ``--radix-cache-backend`` name, its own and those other distributions declare).  A
    target the engine would refuse at start (a name that differs from its declaration, a
    builder that is not there, a model kind it cannot serve, a backend not installed)
    comes with its ``problem`` set, so the listing says why before an engine starts.
    It must not import the engine.  Every implementation is called; the lists are joined.
    """
    return []


@hookspec
def kvcore_cache_created(cache: BasePrefixCache) -> None:
    """Called once for each cache ``create_cache`` builds, after it is built.

    Extension plugins register wrappers of the lifecycle hooks on
    ``cache.plugin_manager`` here (metrics, KV events, write-through to another
    tier).  Every implementation is called; the return value is ignored.
    """


class CacheLifecycleSpec:
    """Lifecycle hooks, kept under SGLang's names, on each built cache's own plugin manager.

    The backend is registered there as the implementation that answers; extension
    plugins add wrappers (``@hookimpl(wrapper=True)``) from ``kvcore_cache_created``.
    """

    @hookspec(firstresult=True)
    def cache_finished_req(self, req: Req, is_insert: bool) -> Any:
        """Hand a finished request's KV to the cache (once per finished request).

        The backend is the implementation that answers and returns True; wrappers
        see the call around it.  firstresult: the first result wins.
        """

    @hookspec(firstresult=True)
    def cache_unfinished_req(self, req: Req, chunked: bool) -> Any:
        """Cache a running request's committed prefix (once per prefill chunk).

        The backend is the implementation that answers and returns True; wrappers
        see the call around it.  firstresult: the first result wins.
        """

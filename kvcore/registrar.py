"""Plugin discovery and the one registrar every kind of registered thing goes through (a leaf module).

Plugins are modules named by entry points of group ``kvcore``; loading is lazy (on the
first lookup) and isolated: a plugin that fails to import, names a hook that does not
exist, or raises while registering is recorded as a :class:`PluginFailure` with its
error, and the others still load.  ``KVCORE_DISABLE_PLUGIN_AUTOLOAD=1`` loads only the
built-ins; ``KVCORE_BLOCK_PLUGINS=a,b`` skips entry points by name.

One registrar, one rule
=======================

Backends, devices, eviction policies, tree components and stores are each a :class:`Kind`: a
registration hook (``kvcore_register_<kinds>(register)``) and a *make* function that
turns one ``register(name, ...)`` call into a spec, or raises (TypeError, ValueError,
:class:`kvcore.PluginError`) to refuse it.  The registrar calls each plugin's hook with
its own ``register``, so every spec knows its :class:`Origin`, and settles the names with
one rule for every kind:

* a name claimed twice by the same plugin is that plugin's registration error;
* a name that kvcore's own distributions claim stays theirs: any other claimant is refused
  (listed as failed, saying why) and the real one stays usable.  *Own* means a distribution
  named in :data:`FIRST_PARTY`, loaded through the entry point that table gives, from code
  that the distribution installed next to kvcore (kvcore's ``plugins/`` folder for an
  editable install, the distribution's own files otherwise): a name prefix proves nothing;
* any other name claimed by more than one plugin is nobody's: every claimant is listed as
  failed, naming all of them, and looking the name up raises that message.

Adding a kind
=============

A new kind is its hookspec in :mod:`kvcore.hookspecs` plus one line in the module that
holds its spec type.  Stores, for example
(``kvcore_register_stores(register)``, with ``register(scheme, factory, description="")``,
in :mod:`kvcore.stores.registry`)::

    STORES = Kind("store", "kvcore_register_stores", _make_store, error=StoreNotFound)

where ``_make_store(origin, scheme, factory, description="") -> StoreSpec`` checks the
arguments and builds the spec; ``STORES.all()``, ``STORES.get(scheme)``,
``STORES.failures()`` and ``STORES.reset()`` are then the lookups, and ``kvcore
backends`` lists its failures with everyone else's (a kind is known once its module is
imported; list that module in :data:`KIND_MODULES` so a listing never misses it).

This module imports nothing of kvcore but its hookspecs and errors, so every module that
declares a kind (:mod:`kvcore.plugins`: backends and eviction policies; :mod:`kvcore.devices`,
:mod:`kvcore.components`, :mod:`kvcore.stores.registry`) depends on it and it on none of them.
"""

from __future__ import annotations

import difflib
import importlib
import os
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Generic, TypeVar

import pluggy

from kvcore import hookspecs
from kvcore.errors import PluginError

__all__ = [
    "BLOCK_ENV",
    "DISABLE_AUTOLOAD_ENV",
    "FIRST_PARTY",
    "KIND_MODULES",
    "Kind",
    "Origin",
    "PluginFailure",
    "PluginRegistry",
    "first_doc_line",
    "get_plugin_manager",
    "hook_names",
    "is_first_party",
    "plugin_failures",
    "registry",
    "reset_plugins",
]

DISABLE_AUTOLOAD_ENV = "KVCORE_DISABLE_PLUGIN_AUTOLOAD"
BLOCK_ENV = "KVCORE_BLOCK_PLUGINS"
ENTRY_POINT_GROUP = "kvcore"
_BUILTIN_MODULES = ("kvcore.builtin_backends", "kvcore.builtin_devices", "kvcore.stores.builtin")

#: kvcore's own distributions and the entry point (group ``kvcore``) each ships; ``kvcore``
#: itself registers its built-in modules directly.  Only these may hold a name against others.
FIRST_PARTY: dict[str, str] = {
    "kvcore-radix": "kvcore_radix.plugin",
    "kvcore-swa": "kvcore_swa.plugin",
    "kvcore-mamba": "kvcore_mamba.plugin",
    "kvcore-unified": "kvcore_unified.plugin",
    "kvcore-hisparse": "kvcore_hisparse.plugin",
    "kvcore-npu": "kvcore_npu.plugin",
    "kvcore-redis": "kvcore_redis.plugin",
    "kvcore-sglang": "kvcore_sglang.target_checks",
}

#: Modules that declare a kind; imported before failures are listed, so none is missed.
KIND_MODULES = ("kvcore.plugins", "kvcore.devices", "kvcore.components", "kvcore.stores.registry")

S = TypeVar("S")


@dataclass(frozen=True, slots=True)
class Origin:
    """Who registered something: the plugin (entry-point name), its distribution and version, and whether
    that distribution is kvcore's own (see the module docstring)."""

    plugin: str
    distribution: str
    version: str
    first_party: bool = False


@dataclass(frozen=True, slots=True)
class PluginFailure:
    plugin: str
    distribution: str
    error: str

    def to_json(self) -> dict[str, str]:
        return {"plugin": self.plugin, "distribution": self.distribution, "error": self.error}


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class Kind(Generic[S]):
    """One kind of registered thing (backend, device, eviction policy, component, ...).

    ``what`` names it in messages, ``hook`` is its registration hook, ``make(origin, name,
    *args, **kwargs)`` builds the spec from one ``register`` call (or raises to refuse it);
    ``error`` is what a lookup of an unknown or disputed name raises, ``unknown`` the
    message (``{name}``, ``{known}``: the registered names).  Constructing a kind declares it.
    """

    def __init__(
        self,
        what: str,
        hook: str,
        make: Callable[..., S],
        *,
        error: type[Exception] = LookupError,
        unknown: str = "",
    ) -> None:
        self.what = what
        self.hook = hook
        self.make = make
        self.error = error
        self.unknown = unknown or f"unknown {what} {{name!r}}; registered {what}s: {{known}}"
        _KINDS.append(self)

    def __repr__(self) -> str:
        return f"Kind({self.what!r}, {self.hook!r})"

    def all(self) -> dict[str, S]:
        """Every usable spec of this kind by name, sorted."""
        return dict(sorted(registry.collected(self).found.items()))

    def get(self, name: str, shown: str | None = None) -> S:
        """The spec registered as ``name``; ``error`` (naming the registered ones, or the dispute) otherwise.

        ``shown`` is the name as the caller wrote it, for the message (``"cuda:3"`` for kind ``cuda``).
        """
        state = registry.collected(self)
        if name in state.conflicts:
            raise self.error(state.conflicts[name])
        try:
            return state.found[name]
        except KeyError:
            known = ", ".join(sorted(state.found)) or "none"
            message = self.unknown.format(name=shown or name, known=known)
            # A name a broken plugin would have registered: say which plugins did not load, and why.
            failed = registry.load_failures() + state.failures
            if failed:
                message += "; not loaded: " + "; ".join(f"{f.plugin} ({f.distribution}): {f.error}" for f in failed)
            raise self.error(message) from None

    def dispute(self, name: str) -> str | None:
        """Why ``name`` is refused to every claimant (registered by two distributions), or None."""
        return registry.collected(self).conflicts.get(name)

    def failures(self) -> list[PluginFailure]:
        """Registrations of this kind that were refused (and why)."""
        return list(registry.collected(self).failures)

    def reset(self) -> None:
        """Collect this kind again on the next lookup (plugins registered since are seen)."""
        registry.forget(self)

    def withdraw(self) -> None:
        """Undeclare this kind (a test's throwaway kind): its failures are no longer listed."""
        registry.forget(self)
        _KINDS.remove(self)


_KINDS: list[Kind[Any]] = []


@dataclass
class _KindState(Generic[S]):
    found: dict[str, S] = field(default_factory=dict)
    conflicts: dict[str, str] = field(default_factory=dict)
    failures: list[PluginFailure] = field(default_factory=list)


@dataclass
class _Loaded:
    """What one load found: the plugin manager, who each plugin is, what failed, each kind's names."""

    pm: pluggy.PluginManager
    origins: dict[str, Origin] = field(default_factory=dict)
    failures: list[PluginFailure] = field(default_factory=list)
    kinds: dict[Kind[Any], _KindState[Any]] = field(default_factory=dict)


# -- loading ----------------------------------------------------------------------------------


def hook_names() -> list[str]:
    """The module-level hooks a plugin may implement (``kvcore_register_backends``, ...)."""
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    return sorted(n for n in dir(hookspecs) if pm.parse_hookspec_opts(hookspecs, n) is not None)


def _hook_mistakes(pm: pluggy.PluginManager, plugin: object, hooks: list[str]) -> list[str]:
    """What is wrong with ``plugin``'s hook functions: one phrase per bad name, each naming the nearest hook."""
    problems = []
    for attr in sorted(dir(plugin)):
        if attr.startswith("_"):
            continue
        marked = pm.parse_hookimpl_opts(plugin, attr) is not None
        if attr in hooks:
            if not marked and callable(getattr(plugin, attr, None)):
                problems.append(f"{attr} lacks the @kvcore.hookimpl decorator, so kvcore would never call it: "
                                "decorate it with @kvcore.hookimpl")
            continue
        near = difflib.get_close_matches(attr, hooks, n=1, cutoff=0.75)
        # A decorated function must be a hook; an undecorated one is a helper unless it looks like a hook.
        if marked or (near and attr.startswith("kvcore_") and callable(getattr(plugin, attr, None))):
            hint = f"; did you mean {near[0]}?" if near else f"; the hooks are {', '.join(hooks)}"
            problems.append(f"{attr} is not a kvcore hook{hint}")
    return problems


def _kvcore_root() -> Path:
    import kvcore

    return Path(kvcore.__file__).resolve().parent.parent


def _installed_with_kvcore(dist: metadata.Distribution, module: object) -> bool:
    """Whether ``module`` is code ``dist`` installed: its own file, or kvcore's ``plugins/`` folder (editable)."""
    source = getattr(module, "__file__", None)
    if not isinstance(source, str):
        return False
    path = Path(source).resolve()
    if (_kvcore_root() / "plugins") in path.parents:
        return True
    return any(Path(str(dist.locate_file(f))).resolve() == path for f in (dist.files or ()))


def is_first_party(ep: metadata.EntryPoint, module: object) -> bool:
    """Whether entry point ``ep`` (loaded as ``module``) is one of kvcore's own: name, entry point and origin."""
    dist = ep.dist
    if dist is None:
        return False
    name = dist.name.lower().replace("_", "-")
    return FIRST_PARTY.get(name) == ep.value and _installed_with_kvcore(dist, module)


def _blocked_names() -> set[str]:
    return {n.strip() for n in os.environ.get(BLOCK_ENV, "").split(",") if n.strip()}


def _load() -> _Loaded:
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    loaded = _Loaded(pm=pm)
    version = metadata.version("kvcore")
    for modname in _BUILTIN_MODULES:
        pm.register(importlib.import_module(modname), name=modname)
        loaded.origins[modname] = Origin(modname, "kvcore", version, first_party=True)
    pm.check_pending()
    if os.environ.get(DISABLE_AUTOLOAD_ENV, "") not in ("", "0", "false", "False"):
        return loaded

    hooks = hook_names()
    blocked = _blocked_names()
    for ep in sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        if ep.name in blocked:
            pm.set_blocked(ep.name)
            continue
        if pm.get_plugin(ep.name) is not None or pm.is_blocked(ep.name):
            continue
        dist = ep.dist.name if ep.dist is not None else "?"
        version = ep.dist.version if ep.dist is not None else "?"
        try:
            module = ep.load()
        except Exception as exc:  # a broken plugin must not stop the others
            loaded.failures.append(PluginFailure(ep.name, dist, f"import failed: {_describe(exc)}"))
            continue
        mistakes = _hook_mistakes(pm, module, hooks)
        if mistakes:
            loaded.failures.append(PluginFailure(ep.name, dist, "invalid plugin: " + "; ".join(mistakes)))
            continue
        try:
            pm.register(module, name=ep.name)
            pm.check_pending()
        except Exception as exc:
            if pm.get_plugin(ep.name) is not None:
                pm.unregister(name=ep.name)
            loaded.failures.append(PluginFailure(ep.name, dist, f"invalid plugin: {_describe(exc)}"))
            continue
        loaded.origins[ep.name] = Origin(ep.name, dist, version, first_party=is_first_party(ep, module))
    return loaded


# -- collecting one kind --------------------------------------------------------------------


def _collect(loaded: _Loaded, kind: Kind[S]) -> _KindState[S]:
    """Call every plugin's ``kind.hook`` with its own ``register``, then settle the names by the one rule."""
    state: _KindState[S] = _KindState()
    claims: dict[str, list[tuple[Origin, S]]] = {}
    for impl in getattr(loaded.pm.hook, kind.hook).get_hookimpls():
        origin = loaded.origins.get(impl.plugin_name, Origin(impl.plugin_name, "?", "?"))
        mine: dict[str, S] = {}

        def register(name: str, *args: Any, _origin: Origin = origin, _mine: dict[str, S] = mine,
                     **kwargs: Any) -> None:
            if not isinstance(name, str) or not name or name != name.strip():
                raise PluginError(f"{kind.what} name must be a non-empty string, got {name!r}")
            if name in _mine:
                raise PluginError(f"{kind.what} {name!r} registered twice by {_origin.distribution}")
            _mine[name] = kind.make(_origin, name, *args, **kwargs)

        try:
            impl.function(register=register)
        except Exception as exc:  # a broken registration must not stop the others
            state.failures.append(
                PluginFailure(origin.plugin, origin.distribution, f"{kind.what} registration failed: {_describe(exc)}")
            )
            continue
        for name, spec in mine.items():
            claims.setdefault(name, []).append((origin, spec))
    for name, found in claims.items():
        _settle(kind, name, found, state)
    return state


def _settle(kind: Kind[S], name: str, claims: list[tuple[Origin, S]], state: _KindState[S]) -> None:
    own = [c for c in claims if c[0].first_party]
    if own and len(own) < len(claims):
        holder = own[0][0].distribution
        for origin, _ in claims:
            if not origin.first_party:
                other = f"{origin.distribution.removeprefix('kvcore-').split('-')[0]}-{name}"
                state.failures.append(PluginFailure(
                    origin.plugin, origin.distribution,
                    f"{kind.what} {name!r} refused: it is already provided by {holder}, one of kvcore's own "
                    f"distributions; register yours under another name (for example {other!r})",
                ))
        claims = own
    if len(claims) == 1:
        state.found[name] = claims[0][1]
        return
    who = " and ".join(f"{o.distribution} (plugin {o.plugin})" for o, _ in claims)
    message = f"{kind.what} {name!r} is registered by both {who}; uninstall one or block it with {BLOCK_ENV}"
    state.conflicts[name] = message
    for origin, _ in claims:
        state.failures.append(PluginFailure(origin.plugin, origin.distribution, message))


class PluginRegistry:
    """The plugins found through the ``kvcore`` entry points and what each kind's hook registered.

    Loaded on first use; each kind is collected on its first lookup.  ``reset()`` forgets
    everything (after changing the environment); ``forget(kind)`` only that kind.
    """

    def __init__(self) -> None:
        self._loaded: _Loaded | None = None
        self._lock = threading.RLock()

    def _get(self) -> _Loaded:
        with self._lock:
            if self._loaded is None:
                self._loaded = _load()
            return self._loaded

    def reset(self) -> None:
        """Forget what was loaded; the next lookup loads again."""
        with self._lock:
            self._loaded = None

    def forget(self, kind: Kind[Any]) -> None:
        with self._lock:
            if self._loaded is not None:
                self._loaded.kinds.pop(kind, None)

    def collected(self, kind: Kind[S]) -> _KindState[S]:
        with self._lock:
            loaded = self._get()
            state = loaded.kinds.get(kind)
            if state is None:
                state = loaded.kinds[kind] = _collect(loaded, kind)
            return state

    @property
    def plugin_manager(self) -> pluggy.PluginManager:
        return self._get().pm

    def origin(self, plugin: str) -> Origin | None:
        """Who plugin ``plugin`` (an entry-point or built-in module name) is, if it loaded."""
        return self._get().origins.get(plugin)

    def load_failures(self) -> list[PluginFailure]:
        """Plugins that failed to import or named hooks that do not exist."""
        return list(self._get().failures)

    def failures(self, kinds: Iterable[Kind[Any]] | None = None) -> list[PluginFailure]:
        """Plugins that failed to load, then every declared kind's refused registrations."""
        for modname in KIND_MODULES:
            importlib.import_module(modname)
        out = list(self._get().failures)
        for kind in kinds if kinds is not None else list(_KINDS):
            out.extend(self.collected(kind).failures)
        return out


#: The registry every kind reads.
registry = PluginRegistry()


def first_doc_line(obj: object) -> str:
    return (getattr(obj, "__doc__", None) or "").strip().split("\n")[0]


def reset_plugins() -> None:
    """Forget what was loaded; the next lookup loads again (tests, env changes)."""
    registry.reset()


def get_plugin_manager() -> pluggy.PluginManager:
    return registry.plugin_manager


def plugin_failures() -> list[PluginFailure]:
    """Plugins that failed to load and registrations that were refused, of every kind."""
    return registry.failures()

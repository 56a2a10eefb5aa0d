"""Plugin discovery: entry-point group ``kvcore``, the backend, device and policy registries.

Loading is lazy (on the first lookup) and isolated: a plugin that fails to import,
fails validation or raises while registering is recorded with its error and the
others still load.  ``KVCORE_DISABLE_PLUGIN_AUTOLOAD=1`` loads only the built-ins;
``KVCORE_BLOCK_PLUGINS=a,b`` skips entry points by name.
"""

from __future__ import annotations

import inspect
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from types import MappingProxyType
from typing import Any

import pluggy

from kvcore import hookspecs
from kvcore.config import CacheConfig
from kvcore.devices import DeviceSpec
from kvcore.errors import PluginError

__all__ = [
    "BackendSpec",
    "PluginFailure",
    "PluginRegistry",
    "registry",
    "available_backends",
    "available_device_specs",
    "available_eviction_policies",
    "get_backend",
    "get_eviction_policy",
    "get_plugin_manager",
    "plugin_failures",
    "reset_plugins",
    "DISABLE_AUTOLOAD_ENV",
    "BLOCK_ENV",
]

DISABLE_AUTOLOAD_ENV = "KVCORE_DISABLE_PLUGIN_AUTOLOAD"
BLOCK_ENV = "KVCORE_BLOCK_PLUGINS"
ENTRY_POINT_GROUP = "kvcore"
_BUILTIN_MODULES = ("kvcore.builtin_backends", "kvcore.builtin_devices", "kvcore.stores.builtin")
_HOOK_NAMES = (
    "kvcore_register_backends",
    "kvcore_register_devices",
    "kvcore_register_eviction_policies",
    "kvcore_register_components",
    "kvcore_register_stores",
    "kvcore_cache_created",
)


def _first_party(distribution: str) -> bool:
    """The kvcore project's own distributions (kvcore, kvcore-radix, ...): their backend names are reserved."""
    return distribution == "kvcore" or distribution.startswith("kvcore-")


@dataclass(frozen=True, slots=True)
class BackendSpec:
    name: str
    factory: Callable[..., Any]
    config: type[CacheConfig]
    description: str
    distribution: str
    version: str
    plugin: str
    # The backend a benchmark compares this one against by default (None: "radix").
    reference: str | None = None

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "reference": self.reference,
            "distribution": self.distribution,
            "version": self.version,
            "plugin": self.plugin,
            "description": self.description,
            "factory": _qualified_name(self.factory),
            "config": f"{self.config.__module__}.{self.config.__qualname__}",
            "options": sorted(self.config.model_fields),
        }


def _qualified_name(factory: Callable[..., Any]) -> str:
    # A factory may be any callable (a functools.partial has no __qualname__).
    module = getattr(factory, "__module__", "?")
    return f"{module}.{getattr(factory, '__qualname__', repr(factory))}"


@dataclass(frozen=True, slots=True)
class PluginFailure:
    plugin: str
    distribution: str
    error: str

    def to_json(self) -> dict:
        return {"plugin": self.plugin, "distribution": self.distribution, "error": self.error}


@dataclass(slots=True)
class _Origin:
    plugin: str
    distribution: str
    version: str


@dataclass
class _State:
    """What one load found: the plugin manager, who registered what, and what failed."""

    pm: pluggy.PluginManager
    origins: dict[str, _Origin] = field(default_factory=dict)
    backends: dict[str, BackendSpec] = field(default_factory=dict)
    devices: dict[str, DeviceSpec] = field(default_factory=dict)
    device_conflicts: dict[str, str] = field(default_factory=dict)
    policies: dict[str, tuple[Callable[[], Any], _Origin]] = field(default_factory=dict)
    failures: list[PluginFailure] = field(default_factory=list)
    conflicts: dict[str, str] = field(default_factory=dict)


def _kvcore_version() -> str:
    return metadata.version("kvcore")


def _blocked_names() -> set[str]:
    return {n.strip() for n in os.environ.get(BLOCK_ENV, "").split(",") if n.strip()}


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _load() -> _State:
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    state = _State(pm=pm)

    import importlib

    for modname in _BUILTIN_MODULES:
        module = importlib.import_module(modname)
        pm.register(module, name=modname)
        state.origins[modname] = _Origin(modname, "kvcore", _kvcore_version())
    pm.check_pending()

    if os.environ.get(DISABLE_AUTOLOAD_ENV, "") not in ("", "0", "false", "False"):
        _collect(state)
        return state

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
            state.failures.append(PluginFailure(ep.name, dist, f"import failed: {_describe(exc)}"))
            continue
        unmarked = [
            n for n in _HOOK_NAMES
            if callable(getattr(module, n, None)) and pm.parse_hookimpl_opts(module, n) is None
        ]
        if unmarked:
            state.failures.append(PluginFailure(
                ep.name, dist,
                f"invalid plugin: {', '.join(unmarked)} lacks the @kvcore.hookimpl decorator, so kvcore would never "
                "call it: decorate it with @kvcore.hookimpl",
            ))
            continue
        try:
            pm.register(module, name=ep.name)
            # A misspelt hookimpl fails here, loudly, for this plugin only.
            pm.check_pending()
        except Exception as exc:
            if pm.get_plugin(ep.name) is not None:
                pm.unregister(name=ep.name)
            state.failures.append(PluginFailure(ep.name, dist, f"invalid plugin: {_describe(exc)}"))
            continue
        state.origins[ep.name] = _Origin(ep.name, dist, version)
    _collect(state)
    return state


def _collect(state: _State) -> None:
    """Call each plugin's registration hooks one by one, so each knows who is calling."""
    pm = state.pm
    claims: dict[str, list[BackendSpec]] = {}

    for impl in pm.hook.kvcore_register_backends.get_hookimpls():
        origin = state.origins.get(impl.plugin_name, _Origin(impl.plugin_name, "?", "?"))
        mine: list[BackendSpec] = []

        def register(
            name: str,
            factory: Callable[..., Any],
            config: type[CacheConfig] = CacheConfig,
            description: str = "",
            *,
            reference: str | None = None,
            _origin: _Origin = origin,
            _mine: list[BackendSpec] = mine,
        ) -> None:
            if not isinstance(name, str) or not name:
                raise PluginError(f"backend name must be a non-empty string, got {name!r}")
            if not callable(factory):
                raise PluginError(f"backend {name!r}: factory {factory!r} is not callable")
            if isinstance(factory, type) and inspect.isabstract(factory):
                missing = ", ".join(sorted(getattr(factory, "__abstractmethods__", ())))
                raise PluginError(
                    f"backend {name!r}: class {factory.__qualname__} is abstract (it does not implement {missing}); "
                    "implement those methods of kvcore.BasePrefixCache"
                )
            if not (isinstance(config, type) and issubclass(config, CacheConfig)):
                raise PluginError(f"backend {name!r}: config must subclass kvcore.CacheConfig, got {config!r}")
            if reference is not None and (not isinstance(reference, str) or not reference):
                raise PluginError(f"backend {name!r}: reference must be a backend name, got {reference!r}")
            if any(s.name == name for s in _mine):
                raise PluginError(f"backend {name!r} registered twice by {_origin.distribution}")
            doc = description or (getattr(factory, "__doc__", None) or "").strip().split("\n")[0]
            _mine.append(
                BackendSpec(
                    name, factory, config, doc, _origin.distribution, _origin.version, _origin.plugin, reference
                )
            )

        try:
            impl.function(register=register)
        except Exception as exc:
            state.failures.append(
                PluginFailure(origin.plugin, origin.distribution, f"registration failed: {_describe(exc)}")
            )
            continue
        for spec in mine:
            claims.setdefault(spec.name, []).append(spec)

    _settle_claims(state, "backend", claims, state.backends, state.conflicts)

    _collect_devices(state)

    for impl in pm.hook.kvcore_register_eviction_policies.get_hookimpls():
        origin = state.origins.get(impl.plugin_name, _Origin(impl.plugin_name, "?", "?"))

        def register_policy(name: str, factory: Callable[[], Any], *, _origin=origin) -> None:
            if name in state.policies and state.policies[name][1].distribution != _origin.distribution:
                raise PluginError(
                    f"eviction policy {name!r} is registered by both "
                    f"{state.policies[name][1].distribution} and {_origin.distribution}"
                )
            state.policies[name] = (factory, _origin)

        try:
            impl.function(register=register_policy)
        except Exception as exc:
            state.failures.append(
                PluginFailure(origin.plugin, origin.distribution, f"policy registration failed: {_describe(exc)}")
            )


def _collect_devices(state: _State) -> None:
    """``kvcore_register_devices``, one plugin at a time; failures and conflicts reported like backends'."""
    claims: dict[str, list[DeviceSpec]] = {}
    options = set(CacheConfig.model_fields)
    for impl in state.pm.hook.kvcore_register_devices.get_hookimpls():
        origin = state.origins.get(impl.plugin_name, _Origin(impl.plugin_name, "?", "?"))
        mine: list[DeviceSpec] = []

        def register(
            name: str,
            *,
            why_unavailable: Callable[[], str | None],
            resolve: Callable[[str], Any] | None = None,
            allocator: Callable[..., Any] | None = None,
            kv_pool: Callable[..., Any] | None = None,
            defaults: dict[str, Any] | None = None,
            synchronize: Callable[[Any], None] | None = None,
            page_aligned_sessions: bool = False,
            description: str = "",
            _origin: _Origin = origin,
            _mine: list[DeviceSpec] = mine,
        ) -> None:
            if not isinstance(name, str) or not name or ":" in name or name != name.strip():
                raise PluginError(f"device name must be a non-empty string without ':', got {name!r}")
            for what, fn in (("why_unavailable", why_unavailable), ("resolve", resolve), ("allocator", allocator),
                             ("kv_pool", kv_pool), ("synchronize", synchronize)):
                if fn is not None and not callable(fn):
                    raise PluginError(f"device {name!r}: {what} {fn!r} is not callable")
            if why_unavailable is None:
                raise PluginError(f"device {name!r}: why_unavailable is required")
            unknown = sorted(set(defaults or {}) - options - {"device"})
            if "device" in (defaults or {}) or unknown:
                raise PluginError(
                    f"device {name!r}: defaults {unknown or ['device']} are not kvcore.CacheConfig options "
                    f"(choose from {', '.join(sorted(options - {'device'}))})"
                )
            if any(s.name == name for s in _mine):
                raise PluginError(f"device {name!r} registered twice by {_origin.distribution}")
            extra: dict[str, Any] = {}
            if resolve is not None:
                extra["resolve"] = resolve
            if synchronize is not None:
                extra["synchronize"] = synchronize
            _mine.append(DeviceSpec(
                name, why_unavailable, allocator=allocator, kv_pool=kv_pool,
                defaults=MappingProxyType(dict(defaults or {})), page_aligned_sessions=bool(page_aligned_sessions),
                description=description, distribution=_origin.distribution, version=_origin.version,
                plugin=_origin.plugin, **extra,
            ))

        try:
            impl.function(register=register)
        except Exception as exc:
            state.failures.append(
                PluginFailure(origin.plugin, origin.distribution, f"device registration failed: {_describe(exc)}")
            )
            continue
        for spec in mine:
            claims.setdefault(spec.name, []).append(spec)

    _settle_claims(state, "device", claims, state.devices, state.device_conflicts)


def _settle_claims(state: _State, kind: str, claims: dict[str, list[Any]], won: dict[str, Any],
                   conflicts: dict[str, str]) -> None:
    """Give each claimed name to its one claimant; report third parties taking a first-party name, and clashes."""
    for name, specs in claims.items():
        own = [s for s in specs if _first_party(s.distribution)]
        if own and len(own) < len(specs):
            # A third party may not take a name the kvcore project's own distributions register.
            for s in specs:
                if s not in own:
                    state.failures.append(PluginFailure(
                        s.plugin, s.distribution,
                        f"{kind} {name!r} is already provided by {own[0].distribution}; register yours under "
                        f"another name (for example {s.distribution.split('-')[0] + '-' + name!r})",
                    ))
            specs = own
        if len(specs) == 1:
            won[name] = specs[0]
            continue
        dists = " and ".join(f"{s.distribution} (plugin {s.plugin})" for s in specs)
        message = f"{kind} {name!r} is registered by both {dists}; uninstall one or block it with {BLOCK_ENV}"
        conflicts[name] = message
        for s in specs:
            state.failures.append(PluginFailure(s.plugin, s.distribution, message))


class PluginRegistry:
    """Backends, device kinds and eviction policies found through the ``kvcore`` entry points, loaded on first use.

    ``kvcore.available_backends()`` and friends read the default registry; a test
    (or a host that wants its own view) builds another and calls ``reset()`` to
    load again after changing the environment.
    """

    def __init__(self) -> None:
        self._state: _State | None = None
        self._lock = threading.Lock()

    def _get(self) -> _State:
        if self._state is None:
            with self._lock:
                if self._state is None:
                    self._state = _load()
        return self._state

    def reset(self) -> None:
        """Forget what was loaded; the next lookup loads again."""
        with self._lock:
            self._state = None

    @property
    def plugin_manager(self) -> pluggy.PluginManager:
        return self._get().pm

    def backends(self) -> dict[str, BackendSpec]:
        return dict(sorted(self._get().backends.items()))

    def failures(self) -> list[PluginFailure]:
        return list(self._get().failures)

    def backend(self, name: str) -> BackendSpec:
        from kvcore.errors import BackendNotFound

        state = self._get()
        if name in state.conflicts:
            raise BackendNotFound(state.conflicts[name])
        try:
            return state.backends[name]
        except KeyError:
            known = ", ".join(sorted(state.backends)) or "none"
            raise BackendNotFound(f"unknown backend {name!r}; known backends: {known}") from None

    def policies(self) -> dict[str, Callable[[], Any]]:
        return {name: factory for name, (factory, _) in sorted(self._get().policies.items())}

    def devices(self) -> dict[str, DeviceSpec]:
        """Every registered device kind by name, usable here or not (``DeviceSpec.availability()``)."""
        return dict(sorted(self._get().devices.items()))

    def device(self, kind: str, shown: str | None = None) -> DeviceSpec:
        """The spec of device kind ``kind``; DeviceUnavailable names the registered kinds when it is unknown.

        ``shown`` is the option as the caller wrote it (``"cuda:3"``), for the message.
        """
        from kvcore.errors import DeviceUnavailable

        state = self._get()
        if kind in state.device_conflicts:
            raise DeviceUnavailable(state.device_conflicts[kind])
        try:
            return state.devices[kind]
        except KeyError:
            known = ", ".join(sorted(state.devices)) or "none"
            raise DeviceUnavailable(
                f"unknown device {shown or kind!r}; registered devices: {known} (`kvcore backends` lists them)"
            ) from None


#: The registry the module-level functions read.
registry = PluginRegistry()


def reset_plugins() -> None:
    """Forget what was loaded; the next lookup loads again (tests, env changes)."""
    registry.reset()


def get_plugin_manager() -> pluggy.PluginManager:
    return registry.plugin_manager


def available_backends() -> dict[str, BackendSpec]:
    """Every usable backend by name: factory, config model, description, distribution, version."""
    return registry.backends()


def available_device_specs() -> dict[str, DeviceSpec]:
    """Every registered device kind by name, usable here or not (see ``kvcore.devices``)."""
    return registry.devices()


def plugin_failures() -> list[PluginFailure]:
    return registry.failures()


def get_backend(name: str) -> BackendSpec:
    """The spec of backend ``name``; BackendNotFound lists the known ones."""
    return registry.backend(name)


def available_eviction_policies() -> list[str]:
    return sorted(registry.policies())


def get_eviction_policy(name: str) -> Callable[[], Any]:
    """The factory of eviction policy ``name``; ValueError lists the known ones."""
    policies = registry.policies()
    try:
        return policies[name]
    except KeyError:
        known = ", ".join(sorted(policies)) or "none"
        raise ValueError(f"unknown eviction_policy {name!r}; known policies: {known}") from None

"""The backend and eviction-policy kinds, and the lookups the rest of kvcore (and its plugins) use.

Discovery and the one registrar every kind goes through (:class:`Kind`, its one conflict
rule, :data:`FIRST_PARTY`, the failures) are :mod:`kvcore.registrar`'s; the names it
exports are re-exported here for callers that import them from this module.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvcore.config import CacheConfig
from kvcore.errors import BackendNotFound, PluginError
from kvcore.pool_builder import DEFAULT_POOLS, PoolBuilder
from kvcore.registrar import (
    BLOCK_ENV,
    DISABLE_AUTOLOAD_ENV,
    FIRST_PARTY,
    Kind,
    Origin,
    PluginFailure,
    PluginRegistry,
    first_doc_line,
    get_plugin_manager,
    hook_names,
    is_first_party,
    plugin_failures,
    registry,
    reset_plugins,
)

if TYPE_CHECKING:
    from kvcore.devices import DeviceSpec

__all__ = [
    "BackendSpec",
    "BACKENDS",
    "EVICTION_POLICIES",
    "FIRST_PARTY",
    "Kind",
    "Origin",
    "PluginFailure",
    "PluginRegistry",
    "PolicySpec",
    "registry",
    "available_backends",
    "available_device_specs",
    "available_eviction_policies",
    "first_doc_line",
    "get_backend",
    "get_eviction_policy",
    "get_plugin_manager",
    "hook_names",
    "is_first_party",
    "plugin_failures",
    "reset_plugins",
    "DISABLE_AUTOLOAD_ENV",
    "BLOCK_ENV",
]


# -- backends -----------------------------------------------------------------------------------


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
    # How its pools are built from its config (kvcore.pool_builder; default: kvcore's own pools).
    pools: PoolBuilder[Any] = DEFAULT_POOLS

    def to_json(self) -> dict[str, Any]:
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


def _make_backend(
    origin: Origin,
    name: str,
    factory: Callable[..., Any],
    config: type[CacheConfig] = CacheConfig,
    description: str = "",
    *,
    reference: str | None = None,
    pools: PoolBuilder[Any] | None = None,
) -> BackendSpec:
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
    if pools is not None and not isinstance(pools, PoolBuilder):
        raise PluginError(f"backend {name!r}: pools must be a kvcore.pool_builder.PoolBuilder, got {pools!r}")
    return BackendSpec(name, factory, config, description or first_doc_line(factory), origin.distribution,
                       origin.version, origin.plugin, reference, pools or DEFAULT_POOLS)


BACKENDS: Kind[BackendSpec] = Kind(
    "backend", "kvcore_register_backends", _make_backend, error=BackendNotFound,
    unknown="unknown backend {name!r}; known backends: {known}",
)


# -- eviction policies --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PolicySpec:
    name: str
    factory: Callable[[], Any]
    distribution: str
    plugin: str


def _make_policy(origin: Origin, name: str, factory: Callable[[], Any]) -> PolicySpec:
    if not callable(factory):
        raise PluginError(f"eviction policy {name!r}: factory {factory!r} is not callable")
    return PolicySpec(name, factory, origin.distribution, origin.plugin)


EVICTION_POLICIES: Kind[PolicySpec] = Kind(
    "eviction policy", "kvcore_register_eviction_policies", _make_policy, error=ValueError,
    unknown="unknown eviction_policy {name!r}; known policies: {known}",
)


# -- module-level lookups -----------------------------------------------------------------------


def available_backends() -> dict[str, BackendSpec]:
    """Every usable backend by name: factory, config model, description, distribution, version."""
    return BACKENDS.all()


def get_backend(name: str) -> BackendSpec:
    """The spec of backend ``name``; BackendNotFound lists the known ones (or names the clash)."""
    return BACKENDS.get(name)


def available_device_specs() -> dict[str, DeviceSpec]:
    """Every registered device kind by name, usable here or not (see ``kvcore.devices``)."""
    from kvcore.devices import available_devices

    return available_devices()


def available_eviction_policies() -> list[str]:
    return sorted(EVICTION_POLICIES.all())


def get_eviction_policy(name: str) -> Callable[[], Any]:
    """The factory of eviction policy ``name``; ValueError lists the known ones."""
    return EVICTION_POLICIES.get(name).factory

"""The store registry: schemes registered through ``kvcore_register_stores``, opened by URL.

Self-contained on purpose: it reads the plugin manager kvcore already loaded
(``kvcore.plugins.get_plugin_manager``) and calls each plugin's
``kvcore_register_stores`` with a ``register`` that knows the calling plugin, so
a scheme two distributions register is refused naming both.  The seam for a
shared registrar is :func:`_collect`: it is the only code that walks hookimpls.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from typing import Any, TypeVar
from urllib.parse import parse_qsl, unquote, urlsplit

from pydantic import BaseModel, ValidationError

from kvcore.errors import KvcoreError, PluginError
from kvcore.stores.base import KVStore

__all__ = [
    "StoreConfigError",
    "StoreNotFound",
    "StoreSpec",
    "StoreURL",
    "available_stores",
    "open_store",
    "reset_stores",
]

M = TypeVar("M", bound=BaseModel)


class StoreNotFound(KvcoreError, LookupError):
    """No store is registered for a URL's scheme."""


class StoreConfigError(KvcoreError, ValueError):
    """A store URL is malformed or carries an unknown or invalid option."""


@dataclass(frozen=True, slots=True)
class StoreURL:
    """A parsed store URL: ``scheme://netloc/path?options``, options as the strings the URL holds."""

    url: str
    scheme: str
    netloc: str
    path: str
    options: dict[str, str]

    @classmethod
    def parse(cls, url: str) -> StoreURL:
        if not isinstance(url, str) or "://" not in url:
            raise StoreConfigError(f"store URL {url!r} has no scheme; write e.g. memory://, file:///dir or redis://host:6379/0")
        parts = urlsplit(url)
        options: dict[str, str] = {}
        for name, value in parse_qsl(parts.query, keep_blank_values=True, strict_parsing=False):
            if name in options:
                raise StoreConfigError(f"store URL {url!r}: option {name!r} is given twice")
            options[name] = value
        return cls(url, parts.scheme.lower(), unquote(parts.netloc), unquote(parts.path), options)

    def options_as(self, model: type[M]) -> M:
        """The options validated by ``model`` (``extra="forbid"``); StoreConfigError names the bad one."""
        try:
            return model(**self.options)
        except ValidationError as exc:
            parts = []
            for err in exc.errors():
                name = ".".join(str(p) for p in err["loc"])
                if err["type"] == "extra_forbidden":
                    known = ", ".join(sorted(model.model_fields)) or "none"
                    parts.append(f"unknown option {name!r} (options: {known})")
                else:
                    parts.append(f"option {name!r}: {err['msg']} (got {err.get('input')!r})")
            raise StoreConfigError(f"store URL {self.url!r}: " + "; ".join(parts)) from None


@dataclass(frozen=True, slots=True)
class StoreSpec:
    """One registered scheme: ``factory(StoreURL) -> KVStore``."""

    scheme: str
    factory: Callable[[StoreURL], KVStore]
    description: str
    distribution: str
    plugin: str

    def to_json(self) -> dict[str, str]:
        return {"scheme": self.scheme, "description": self.description, "distribution": self.distribution,
                "plugin": self.plugin}


@dataclass
class _Found:
    pm: Any
    specs: dict[str, StoreSpec]
    failures: list[str]


_lock = threading.Lock()
_found: _Found | None = None


def _distribution_of(plugin_name: str) -> str:
    """The distribution of an entry point by name (the core's own modules are kvcore's)."""
    if plugin_name.startswith("kvcore."):
        return "kvcore"
    for ep in metadata.entry_points(group="kvcore", name=plugin_name):
        if ep.dist is not None:
            return ep.dist.name
    return "?"


def _collect(pm: Any) -> _Found:
    """Call every ``kvcore_register_stores`` once, one plugin at a time; settle each scheme."""
    claims: dict[str, list[StoreSpec]] = {}
    failures: list[str] = []
    for impl in pm.hook.kvcore_register_stores.get_hookimpls():
        dist = _distribution_of(impl.plugin_name)
        mine: list[StoreSpec] = []

        def register(scheme: str, factory: Callable[[StoreURL], KVStore], description: str = "", *,
                     _dist: str = dist, _plugin: str = impl.plugin_name, _mine: list[StoreSpec] = mine) -> None:
            if not isinstance(scheme, str) or not scheme or scheme != scheme.lower() or "://" in scheme:
                raise PluginError(f"store scheme must be a lower-case name without '://', got {scheme!r}")
            if not callable(factory):
                raise PluginError(f"store {scheme!r}: factory {factory!r} is not callable")
            if any(s.scheme == scheme for s in _mine):
                raise PluginError(f"store {scheme!r} registered twice by {_dist}")
            _mine.append(StoreSpec(scheme, factory, description, _dist, _plugin))

        try:
            impl.function(register=register)
        except Exception as exc:  # one broken plugin must not hide the others' stores
            failures.append(f"{impl.plugin_name} ({dist}): store registration failed: {type(exc).__name__}: {exc}")
            continue
        for spec in mine:
            claims.setdefault(spec.scheme, []).append(spec)
    specs: dict[str, StoreSpec] = {}
    for scheme, got in claims.items():
        if len(got) == 1:
            specs[scheme] = got[0]
        else:
            both = " and ".join(s.distribution for s in got)
            failures.append(f"store {scheme!r} is registered by both {both}; uninstall one")
    return _Found(pm, dict(sorted(specs.items())), failures)


def _state() -> _Found:
    global _found
    from kvcore.plugins import get_plugin_manager

    pm = get_plugin_manager()
    with _lock:
        # A reload of the plugins (reset_plugins) builds a new manager: collect again.
        if _found is None or _found.pm is not pm:
            _found = _collect(pm)
        return _found


def reset_stores() -> None:
    """Forget the collected schemes; the next lookup collects again."""
    global _found
    with _lock:
        _found = None


def available_stores() -> dict[str, StoreSpec]:
    """Every registered store scheme: factory, description, distribution."""
    return dict(_state().specs)


def store_failures() -> list[str]:
    """Why a plugin's stores were not registered (one line each)."""
    return list(_state().failures)


def open_store(url: str) -> KVStore:
    """Open the store ``url`` addresses: ``memory://[name][?max_bytes=N&ttl=S]``, ``file:///dir[?ttl=S]``,
    or a plugin's scheme (``redis://host:port/db``, ``redis+cluster://host:port,...`` from kvcore-redis).

    A malformed URL or a bad option raises StoreConfigError naming it, an unknown
    scheme StoreNotFound listing the known ones; opening never fails because the
    store is down: that store answers misses until it comes back.
    """
    parsed = StoreURL.parse(url)
    specs = _state().specs
    spec = specs.get(parsed.scheme)
    if spec is None:
        known = ", ".join(f"{s}://" for s in specs) or "none"
        raise StoreNotFound(f"no store for scheme {parsed.scheme + '://'!r} in {url!r}; known: {known}")
    try:
        return spec.factory(parsed)
    except StoreConfigError:
        raise
    except (TypeError, ValueError) as exc:
        raise StoreConfigError(f"store URL {url!r}: {exc}") from None

"""The store registry: schemes registered through ``kvcore_register_stores``, opened by URL.

Schemes are one :class:`kvcore.plugins.Kind` of the one registrar, with its one conflict
rule: kvcore's own distributions keep their schemes, a scheme two others register is
refused naming both, and a refused registration is listed with the other plugin failures.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar
from urllib.parse import parse_qsl, unquote, urlsplit

from pydantic import BaseModel, ValidationError

from kvcore.errors import KvcoreError, PluginError
from kvcore.registrar import Kind, Origin, PluginFailure
from kvcore.stores.base import KVStore

__all__ = [
    "STORES",
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


def _make_store(origin: Origin, scheme: str, factory: Callable[[StoreURL], KVStore],
                description: str = "") -> StoreSpec:
    """One ``register(scheme, factory, description)`` call of ``kvcore_register_stores``, checked."""
    if scheme != scheme.lower() or "://" in scheme:
        raise PluginError(f"store scheme must be a lower-case name without '://', got {scheme!r}")
    if not callable(factory):
        raise PluginError(f"store {scheme!r}: factory {factory!r} is not callable")
    return StoreSpec(scheme, factory, description, origin.distribution, origin.plugin)


STORES: Kind[StoreSpec] = Kind("store", "kvcore_register_stores", _make_store, error=StoreNotFound)


def reset_stores() -> None:
    """Forget the collected schemes; the next lookup collects them again."""
    STORES.reset()


def available_stores() -> dict[str, StoreSpec]:
    """Every registered store scheme: factory, description, distribution."""
    return STORES.all()


def store_failures() -> list[PluginFailure]:
    """Store registrations that were refused, and why."""
    return STORES.failures()


def open_store(url: str) -> KVStore:
    """Open the store ``url`` addresses: ``memory://[name][?max_bytes=N&ttl=S]``, ``file:///dir[?ttl=S]``,
    or a plugin's scheme (``redis://host:port/db``, ``redis+cluster://host:port,...`` from kvcore-redis).

    A malformed URL or a bad option raises StoreConfigError naming it, an unknown
    scheme StoreNotFound listing the known ones; opening never fails because the
    store is down: that store answers misses until it comes back.
    """
    parsed = StoreURL.parse(url)
    specs = STORES.all()
    spec = specs.get(parsed.scheme)
    if spec is None:
        disputed = STORES.dispute(parsed.scheme)
        if disputed:
            raise StoreNotFound(f"{disputed} (in {url!r})")
        known = ", ".join(f"{s}://" for s in specs) or "none"
        raise StoreNotFound(f"no store for scheme {parsed.scheme + '://'!r} in {url!r}; known: {known} (a "
                            "distribution adds one with the kvcore_register_stores hook)")
    try:
        return spec.factory(parsed)
    except StoreConfigError:
        raise
    except (TypeError, ValueError) as exc:
        raise StoreConfigError(f"store URL {url!r}: {exc}") from None

"""``create_cache``: validated options in, a built backend on its own pools out."""

from __future__ import annotations

from typing import Any

import pluggy
from pydantic import ValidationError

from kvcore import hookspecs
from kvcore.config import CacheInitParams
from kvcore.devices import check_device
from kvcore.errors import KvcoreError
from kvcore.plugins import get_backend, get_plugin_manager

__all__ = ["create_cache", "ConfigError", "attach_lifecycle"]


class ConfigError(KvcoreError, ValueError):
    """An option given to ``create_cache`` is unknown or invalid."""


def _format_validation_error(backend: str, exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        field = ".".join(str(p) for p in err["loc"])
        message = err["msg"].removeprefix("Value error, ")
        if not field:
            parts.append(message)
        elif err["type"] == "extra_forbidden":
            parts.append(f"unknown option {field!r}")
        else:
            parts.append(f"option {field!r}: {message} (got {err.get('input')!r})")
    return f"backend {backend!r}: " + "; ".join(parts)


class _BackendAnswer:
    """Answers the lifecycle hooks of one cache by calling the backend's methods."""

    def __init__(self, cache):
        self.cache = cache

    @hookspecs.hookimpl(trylast=True)
    def cache_finished_req(self, req, is_insert):
        self.cache.cache_finished_req(req, is_insert)
        return True

    @hookspecs.hookimpl(trylast=True)
    def cache_unfinished_req(self, req, chunked):
        self.cache.cache_unfinished_req(req, chunked)
        return True


def attach_lifecycle(cache) -> pluggy.PluginManager:
    """Give ``cache`` its own plugin manager, with the backend as the answering implementation."""
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs.CacheLifecycleSpec)
    pm.register(_BackendAnswer(cache), name="backend")
    pm.check_pending()
    cache.plugin_manager = pm
    cache.hook = pm.hook
    return pm


def create_cache(name: str, **options: Any):
    """Build backend ``name`` with pools made from ``options``.

    Options are validated by the backend's config model (``extra="forbid"``); an
    unknown backend raises BackendNotFound listing the known ones, a bad option
    raises ConfigError naming the backend and the field, and a device that is
    unknown or not usable here raises DeviceUnavailable saying what is missing
    (``torch_npu is not installed``), before any pool is built.  The pools come
    from the device's allocator and K/V-pool classes (``config.pool_device()``),
    whose session rule the built cache carries (``session_page_aligned``).
    """
    spec = get_backend(name)
    try:
        config = spec.config(**options)
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(name, exc)) from None
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"backend {name!r}: {exc}") from None
    # The pools live on the torch device the kind resolves to (a plugin's kind may map onto another).
    config._torch_device = str(check_device(config.device))
    pools = config.pool_device()
    params = CacheInitParams.from_config(config)
    try:
        cache = spec.factory(params)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"backend {name!r}: {exc}") from exc
    cache.backend_name = name
    cache.session_page_aligned = pools.page_aligned_sessions
    attach_lifecycle(cache)
    get_plugin_manager().hook.kvcore_cache_created(cache=cache)
    return cache

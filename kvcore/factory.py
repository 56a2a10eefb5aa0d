"""``create_cache``: validated options in, a built backend on its own pools out."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import pluggy
from pydantic import ValidationError

from kvcore import hookspecs
from kvcore.cache import BasePrefixCache
from kvcore.capabilities import check_declared
from kvcore.config import CacheConfig, CacheInitParams, did_you_mean
from kvcore.devices import check_device, get_device
from kvcore.errors import DeviceUnavailable, KvcoreError, PluginError
from kvcore.plugins import BackendSpec, get_backend, get_plugin_manager
from kvcore.pool_builder import DEFAULT_POOLS, Placement, PoolBuilder

if TYPE_CHECKING:
    from kvcore.record import Req

__all__ = [
    "ConfigError",
    "attach_lifecycle",
    "build_pools",
    "create_cache",
    "device_defaults",
    "resolve_placement",
    "validate_options",
]


class ConfigError(KvcoreError, ValueError):
    """An option given to ``create_cache`` is unknown or invalid."""


def _format_validation_error(backend: str, exc: ValidationError, known: Iterable[str] = ()) -> str:
    parts = []
    for err in exc.errors():
        field = ".".join(str(p) for p in err["loc"])
        message = err["msg"].removeprefix("Value error, ")
        if not field:
            parts.append(message)
        elif err["type"] == "extra_forbidden":
            parts.append(f"unknown option {field!r}{did_you_mean(field, known)}")
        else:
            parts.append(f"option {field!r}: {message} (got {err.get('input')!r})")
    return f"backend {backend!r}: " + "; ".join(parts)


class _BackendAnswer:
    """Answers the lifecycle hooks of one cache by calling the backend's methods."""

    def __init__(self, cache: BasePrefixCache) -> None:
        self.cache = cache

    @hookspecs.hookimpl(trylast=True)
    def cache_finished_req(self, req: Req, is_insert: bool) -> bool:
        self.cache.cache_finished_req(req, is_insert)
        return True

    @hookspecs.hookimpl(trylast=True)
    def cache_unfinished_req(self, req: Req, chunked: bool) -> bool:
        self.cache.cache_unfinished_req(req, chunked)
        return True


def attach_lifecycle(cache: BasePrefixCache) -> pluggy.PluginManager:
    """Give ``cache`` its own plugin manager, with the backend as the answering implementation."""
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs.CacheLifecycleSpec)
    pm.register(_BackendAnswer(cache), name="backend")
    pm.check_pending()
    cache.plugin_manager = pm
    cache.hook = pm.hook
    return pm


def device_defaults(spec: BackendSpec, options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` with the defaults of the device they name (``npu``: ``page_size=128``) for the backend's
    options not given; an unknown device is left to :func:`resolve_placement` to report."""
    device = options.get("device", spec.config.model_fields["device"].default)
    if not isinstance(device, str):
        return dict(options)
    try:
        kind = get_device(device)
    except DeviceUnavailable:
        return dict(options)
    fields = spec.config.model_fields
    return {**{k: v for k, v in kind.defaults.items() if k in fields and k not in options}, **options}


def resolve_placement(device: str, pools: PoolBuilder[Any] = DEFAULT_POOLS) -> Placement:
    """Where pools for option ``device`` live: DeviceUnavailable (one line, what is missing) when nowhere."""
    torch_device = check_device(device)
    kind = get_device(pools.device_kind) if pools.device_kind is not None else get_device(device)
    return Placement(kind, torch_device)


def validate_options(name: str, **options: Any) -> CacheConfig:
    """Backend ``name``'s validated config for ``options`` (device defaults applied); ConfigError names the field."""
    spec = get_backend(name)
    try:
        return spec.config(**device_defaults(spec, options))
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(name, exc, spec.config.model_fields)) from None
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"backend {name!r}: {exc}") from None


def build_pools(name: str, config: CacheConfig) -> CacheInitParams:
    """The pools backend ``name`` runs on for ``config``, built by its registered PoolBuilder."""
    pools = get_backend(name).pools
    return pools.build(config, resolve_placement(config.device, pools))


def create_cache(name: str, **options: Any) -> BasePrefixCache:
    """Build backend ``name`` with pools made from ``options``.

    Options are validated by the backend's config model (``extra="forbid"``, strict);
    an unknown backend raises BackendNotFound listing the known ones, a bad option
    raises ConfigError naming the backend and the field, and a device that is
    unknown or not usable here raises DeviceUnavailable saying what is missing
    (``torch_npu is not installed``), before any pool is built.  The device's
    defaults apply to options not given; the pools come from the backend's
    :class:`kvcore.pool_builder.PoolBuilder` (by default the device's allocator and
    K/V-pool classes), and the built cache carries the device's session rule
    (``session_page_aligned``).
    """
    spec = get_backend(name)
    config = validate_options(name, **options)
    placement = resolve_placement(config.device, spec.pools)
    params = spec.pools.build(config, placement)
    try:
        cache = spec.factory(params)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"backend {name!r}: {exc}") from exc
    if not isinstance(cache, BasePrefixCache):
        raise PluginError(
            f"backend {name!r}: its factory returned {type(cache).__name__}, not a kvcore.BasePrefixCache"
        )
    check_declared(cache, name)
    cache.backend_name = name
    cache.session_page_aligned = placement.device.page_aligned_sessions
    attach_lifecycle(cache)
    get_plugin_manager().hook.kvcore_cache_created(cache=cache)
    return cache

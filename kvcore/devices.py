"""Device kinds: what a cache's pools run on, registered through ``kvcore_register_devices``.

A device kind (``cpu``, ``cuda``, a plugin's ``npu``) is a :class:`DeviceSpec`:

* ``why_unavailable()``: ``None`` when the kind is usable here, else why not, in a few
  words ("torch_npu is not installed").  It runs when ``kvcore backends`` lists the
  devices, so it imports nothing heavy (``importlib.util.find_spec``, not ``import``).
* ``resolve(text)``: the ``torch.device`` for ``"cuda:1"`` and the like; heavy imports
  (``torch_npu``) happen here, only when a cache is really built on the device.
* ``allocator`` / ``kv_pool``: the classes the default :class:`kvcore.pool_builder.PoolBuilder`
  builds the token allocator and the K/V buffer with (default:
  :class:`kvcore.pools.TokenToKVPoolAllocator`, :class:`kvcore.pools.MHATokenToKVPool`); the K/V
  pool's ``set_kv_buffer`` is how K/V is written on this device.  Backends whose builder makes
  its own allocator (SWA's two pools) keep theirs and only take the torch device.
* ``defaults``: :class:`kvcore.CacheConfig` options ``create_cache`` sets for the device when
  the caller does not (``{"page_size": 128}``).
* ``page_aligned_sessions``: a streaming session reuses only whole pages of a finished
  turn (SGLang's rule for Ascend); see :class:`kvcore.StreamingSession`.
* ``synchronize(device)``: wait for queued work (the bench times steps with it).

:func:`check_device` turns an option string into a ``torch.device`` or raises
:class:`kvcore.DeviceUnavailable` in one line that says what is missing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from kvcore.config import CacheConfig
from kvcore.errors import DeviceUnavailable, PluginError
from kvcore.registrar import Kind, Origin

__all__ = [
    "DEVICES",
    "DeviceSpec",
    "available_devices",
    "check_device",
    "device_kind",
    "get_device",
    "synchronize",
]


def _torch_device(text: str) -> torch.device:
    return torch.device(text)


def _no_sync(device: torch.device) -> None:
    return None


@dataclass(frozen=True, slots=True)
class DeviceSpec:
    """A registered device kind (see the module docstring for each field)."""

    name: str
    why_unavailable: Callable[[], str | None]
    resolve: Callable[[str], torch.device] = _torch_device
    allocator: Callable[..., Any] | None = None
    kv_pool: Callable[..., Any] | None = None
    defaults: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    synchronize: Callable[[torch.device], None] = _no_sync
    page_aligned_sessions: bool = False
    description: str = ""
    distribution: str = "?"
    version: str = "?"
    plugin: str = "?"

    def availability(self) -> str | None:
        """``why_unavailable()``, with a probe that raises reported as its error (never raised)."""
        try:
            return self.why_unavailable()
        except Exception as exc:  # a broken probe must not break `kvcore backends`
            return f"availability check failed: {type(exc).__name__}: {exc}"

    def to_json(self) -> dict[str, Any]:
        why = self.availability()
        return {
            "name": self.name,
            "available": why is None,
            "why_not": why,
            "distribution": self.distribution,
            "version": self.version,
            "plugin": self.plugin,
            "description": self.description,
            "allocator": _qualname(self.allocator) if self.allocator is not None else None,
            "kv_pool": _qualname(self.kv_pool) if self.kv_pool is not None else None,
            "defaults": dict(self.defaults),
            "page_aligned_sessions": self.page_aligned_sessions,
        }


def _qualname(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


def device_kind(device: str | torch.device) -> str:
    """The registered kind a device option names: ``"cuda:1"`` -> ``"cuda"``."""
    if isinstance(device, torch.device):
        return device.type
    return str(device).split(":", 1)[0].strip()


def _make_device(
    origin: Origin,
    name: str,
    *,
    why_unavailable: Callable[[], str | None],
    resolve: Callable[[str], torch.device] | None = None,
    allocator: Callable[..., Any] | None = None,
    kv_pool: Callable[..., Any] | None = None,
    defaults: Mapping[str, Any] | None = None,
    synchronize: Callable[[torch.device], None] | None = None,
    page_aligned_sessions: bool = False,
    description: str = "",
) -> DeviceSpec:
    """One ``register(name, ...)`` call of ``kvcore_register_devices`` (see the hookspec), checked."""
    if ":" in name:
        raise PluginError(f"device name must not contain ':', got {name!r}")
    for what, fn in (("why_unavailable", why_unavailable), ("resolve", resolve), ("allocator", allocator),
                     ("kv_pool", kv_pool), ("synchronize", synchronize)):
        if fn is not None and not callable(fn):
            raise PluginError(f"device {name!r}: {what} {fn!r} is not callable")
    if why_unavailable is None:
        raise PluginError(f"device {name!r}: why_unavailable is required")
    options = set(CacheConfig.model_fields)
    unknown = sorted(set(defaults or {}) - options - {"device"})
    if "device" in (defaults or {}) or unknown:
        raise PluginError(
            f"device {name!r}: defaults {unknown or ['device']} are not kvcore.CacheConfig options "
            f"(choose from {', '.join(sorted(options - {'device'}))})"
        )
    return DeviceSpec(
        name, why_unavailable, resolve=resolve or _torch_device, allocator=allocator, kv_pool=kv_pool,
        defaults=MappingProxyType(dict(defaults or {})), synchronize=synchronize or _no_sync,
        page_aligned_sessions=bool(page_aligned_sessions), description=description,
        distribution=origin.distribution, version=origin.version, plugin=origin.plugin,
    )


DEVICES: Kind[DeviceSpec] = Kind(
    "device", "kvcore_register_devices", _make_device, error=DeviceUnavailable,
    unknown="unknown device {name!r}; registered devices: {known} (`kvcore backends` lists them)",
)


def available_devices() -> dict[str, DeviceSpec]:
    """Every registered device kind by name (usable here or not: see ``availability()``)."""
    return DEVICES.all()


def get_device(device: str | torch.device) -> DeviceSpec:
    """The spec of ``device``'s kind; DeviceUnavailable names the registered kinds when it is unknown."""
    return DEVICES.get(device_kind(device), shown=str(device))


def check_device(device: str | torch.device) -> torch.device:
    """Return ``device`` as a torch.device, or raise DeviceUnavailable saying what is missing."""
    spec = get_device(device)
    why = spec.availability()
    text = str(device)
    if why is not None:
        raise DeviceUnavailable(f"device {text!r} is not available: {why}")
    try:
        return spec.resolve(text)
    except DeviceUnavailable:
        raise
    except (RuntimeError, TypeError, ValueError) as exc:
        raise DeviceUnavailable(f"device {text!r}: {exc}") from None


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (a no-op on the CPU)."""
    get_device(device).synchronize(device)

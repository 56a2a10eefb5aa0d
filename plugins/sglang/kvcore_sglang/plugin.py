"""Entry point of kvcore-sglang in SGLang's plugin group ``sglang.srt.plugins``.

SGLang's ``load_plugins()`` calls :func:`register_with_sglang` first thing in every
scheduler process (they are spawned, so an entry point is what reaches every
TP/PP/DP rank), before the tree cache is built.  It only registers names: the
factories import kvcore, its backends and the contract module of the running SGLang
when SGLang builds a tree cache with ``--radix-cache-backend kvcore-...``.
"""

from __future__ import annotations

import importlib
import json
import logging
import re
from importlib.metadata import EntryPoint, entry_points, version
from typing import Any

from kvcore_sglang.config import SUPPORTED_SGLANG, TARGETS, Target

__all__ = ["HICACHE_BACKEND", "TARGET_GROUP", "KvcoreFactory", "contract_module", "declared_targets",
           "hicache_extra_config", "load_declared_target", "register_with_sglang"]

#: Where another distribution declares an SGLang name for its kvcore backend, without kvcore-sglang
#: knowing it: ``mybackend = "mypkg.sglang:TARGET"`` in this entry-point group registers
#: ``--radix-cache-backend kvcore-mybackend``.  ``TARGET`` is a :class:`kvcore_sglang.Target` named
#: ``kvcore-mybackend``; it is loaded only when SGLang builds the cache (registration reads metadata).
TARGET_GROUP = "kvcore_sglang.targets"

_log = logging.getLogger(__name__)


#: kvcore's stores as a HiCache L3 backend: what ``--hicache-storage-backend dynamic`` loads.  SGLang's
#: ``StorageBackendFactory`` builds a registered name only if it is one of its own built-ins, so kvcore's is
#: reached through ``dynamic`` and these names in ``--hicache-storage-backend-extra-config``.
HICACHE_BACKEND = {
    "backend_name": "kvcore",
    "module_path": "kvcore_sglang.hicache_storage",
    "class_name": "KvcoreHiCacheStorage",
    "interface_v1": 1,
}


def hicache_extra_config(store_url: str, **more: Any) -> str:
    """The JSON for ``--hicache-storage-backend-extra-config``: :data:`HICACHE_BACKEND`, ``store_url`` and ``more``."""
    return json.dumps({**HICACHE_BACKEND, "store_url": store_url, **more})


def contract_module() -> Any:
    """The module that implements the running SGLang's tree-cache contract (``kvcore_sglang.v0_5_19``).

    Raises RuntimeError naming the installed and the supported versions when there is none.
    """
    installed = version("sglang")
    found = re.match(r"(\d+)\.(\d+)\.(\d+)", installed)
    release = ".".join(found.groups()) if found else installed
    if release not in SUPPORTED_SGLANG:
        raise RuntimeError(
            f"kvcore-sglang has no contract module for SGLang {installed}; it supports SGLang "
            f"{', '.join(SUPPORTED_SGLANG)}: install one of those, or choose another --radix-cache-backend"
        )
    return importlib.import_module("kvcore_sglang.v" + release.replace(".", "_"))


def declared_targets() -> list[tuple[str, EntryPoint]]:
    """``(name, entry point)`` of every target another distribution declares in :data:`TARGET_GROUP`.

    Reads installed metadata only: nothing is imported.
    """
    own = {t.name for t in TARGETS}
    found = []
    for ep in entry_points(group=TARGET_GROUP):
        name = f"kvcore-{ep.name}"
        if name in own:
            _log.warning("kvcore-sglang: %s (declared by %s) is kvcore-sglang's own name; left out", name, ep.value)
        else:
            found.append((name, ep))
    return found


def load_declared_target(name: str, ep: EntryPoint) -> Target:
    """The :class:`~kvcore_sglang.config.Target` entry point ``ep`` declares for ``name``; RuntimeError naming the
    entry point when it does not load or is not a Target of that name."""
    where = f"entry point {ep.name} = {ep.value!r} (group {TARGET_GROUP})"
    try:
        loaded = ep.load()
    except Exception as exc:  # noqa: BLE001 - any import failure of a third party's module
        raise RuntimeError(f"--radix-cache-backend {name}: {where} does not load: "
                           f"{type(exc).__name__}: {exc}") from exc
    if not isinstance(loaded, Target) or loaded.name != name:
        raise RuntimeError(f"--radix-cache-backend {name}: {where} must name a kvcore_sglang.Target "
                           f"with name={name!r}, got {loaded!r}")
    return loaded


class KvcoreFactory:
    """What SGLang's registry holds for one name: called with a ``TreeCacheBuildContext``.

    ``target`` is kvcore-sglang's own; a name another distribution declares comes as its
    ``entry_point``, loaded on the first call.
    """

    def __init__(self, target: Target | None = None, *, entry_point: EntryPoint | None = None):
        if (target is None) == (entry_point is None):
            raise TypeError("KvcoreFactory takes a target or an entry point, one of them")
        self.target = target
        self.entry_point = entry_point
        self.name = target.name if target is not None else f"kvcore-{entry_point.name}"  # type: ignore[union-attr]

    def resolved_target(self) -> Target:
        """The target, loading a declared one (RuntimeError naming the entry point if it is not one)."""
        if self.target is None:
            assert self.entry_point is not None
            self.target = load_declared_target(self.name, self.entry_point)
        return self.target

    def __call__(self, ctx: Any) -> Any:
        target = self.resolved_target()
        if target.builder is None:
            return contract_module().build_tree_cache(target, ctx)
        # A target with a builder of its own: imported only now.
        module, _, function = target.builder.partition(":")
        return getattr(importlib.import_module(module), function)(target, ctx)

    def __repr__(self) -> str:
        if self.target is None:
            return f"KvcoreFactory({self.name!r}, declared by {self.entry_point.value!r})"  # type: ignore[union-attr]
        return f"KvcoreFactory({self.target.name!r} -> kvcore backend {self.target.backend!r})"


def register_with_sglang() -> None:
    """Register every name of :data:`kvcore_sglang.config.TARGETS` with SGLang's radix-cache registry.

    A new name is one more :class:`~kvcore_sglang.config.Target` in ``TARGETS`` (with
    ``builder="kvcore_sglang.mymodule:build"`` when the contract module does not build it), or,
    from another distribution, one entry point in :data:`TARGET_GROUP`.

    Idempotent: ``load_plugins`` may run more than once per process, and SGLang's
    registry raises on a second registration, so a name already held by this
    plugin is left as it is.  A name another distribution registered first is
    left to it, with a warning.
    """
    from sglang.srt.mem_cache.registry import (  # type: ignore[import-not-found,unused-ignore]
        get_radix_cache_factory,
        register_radix_cache_backend,
    )

    factories = [KvcoreFactory(t) for t in TARGETS] + [KvcoreFactory(entry_point=ep) for _, ep in declared_targets()]
    for factory in factories:
        held = get_radix_cache_factory(factory.name)
        if held is None:
            register_radix_cache_backend(factory.name, factory)
        elif not isinstance(held, KvcoreFactory):
            _log.warning("kvcore-sglang: --radix-cache-backend %s is already registered by %r; left to it",
                         factory.name, held)

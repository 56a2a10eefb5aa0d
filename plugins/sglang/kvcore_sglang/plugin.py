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
from importlib.metadata import version
from typing import Any

from kvcore_sglang.config import SUPPORTED_SGLANG, TARGETS, Target

__all__ = ["HICACHE_BACKEND", "KvcoreFactory", "contract_module", "hicache_extra_config", "register_with_sglang"]

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


class KvcoreFactory:
    """What SGLang's registry holds for one name: called with a ``TreeCacheBuildContext``."""

    def __init__(self, target: Target):
        self.target = target

    def __call__(self, ctx: Any) -> Any:
        if self.target.builder is None:
            return contract_module().build_tree_cache(self.target, ctx)
        # A target with a builder of its own (another module of this package): imported only now.
        module, _, function = self.target.builder.partition(":")
        return getattr(importlib.import_module(module), function)(self.target, ctx)

    def __repr__(self) -> str:
        return f"KvcoreFactory({self.target.name!r} -> kvcore backend {self.target.backend!r})"


def register_with_sglang() -> None:
    """Register every name of :data:`kvcore_sglang.config.TARGETS` with SGLang's radix-cache registry.

    A new name is one more :class:`~kvcore_sglang.config.Target` in ``TARGETS`` (with
    ``builder="kvcore_sglang.mymodule:build"`` when the contract module does not build it).

    Idempotent: ``load_plugins`` may run more than once per process, and SGLang's
    registry raises on a second registration, so a name already held by this
    plugin is left as it is.  A name another distribution registered first is
    left to it, with a warning.
    """
    from sglang.srt.mem_cache.registry import (  # type: ignore[import-not-found,unused-ignore]
        get_radix_cache_factory,
        register_radix_cache_backend,
    )

    for target in TARGETS:
        held = get_radix_cache_factory(target.name)
        if held is None:
            register_radix_cache_backend(target.name, KvcoreFactory(target))
        elif not isinstance(held, KvcoreFactory):
            _log.warning("kvcore-sglang: --radix-cache-backend %s is already registered by %r; left to it",
                         target.name, held)

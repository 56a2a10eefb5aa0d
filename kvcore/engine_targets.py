"""The names engine integrations give kvcore backends (``kvcore backends`` lists them, checked).

An integration (kvcore-sglang: SGLang's ``--radix-cache-backend kvcore-...`` names)
answers the ``kvcore_engine_targets`` hook with :class:`EngineTarget` records.  A
target the engine would refuse when it starts carries its ``problem``, so a wrong
declaration shows when the backends are listed, not in an engine's start-up log.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, cast

from kvcore.registrar import PluginFailure, get_plugin_manager, registry

__all__ = ["EngineTarget", "engine_targets"]


@dataclass(frozen=True, slots=True)
class EngineTarget:
    """One name an engine takes for a kvcore backend.

    ``engine``: the engine ("sglang"); ``backend``: the kvcore backend it builds; ``serves``:
    the model kinds it takes; ``declared_by``: the distribution that declares it;
    ``problem``: why the engine would refuse it (None: it would build).
    """

    name: str
    engine: str
    backend: str
    declared_by: str
    serves: tuple[str, ...] = ()
    description: str = ""
    problem: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "engine": self.engine, "backend": self.backend, "declared_by": self.declared_by,
                "serves": list(self.serves), "description": self.description, "problem": self.problem}


def engine_targets() -> tuple[list[EngineTarget], list[PluginFailure]]:
    """Every integration's targets, and the integrations whose hook failed (each listed with why)."""
    targets: list[EngineTarget] = []
    failures: list[PluginFailure] = []
    for impl in get_plugin_manager().hook.kvcore_engine_targets.get_hookimpls():
        origin = registry.origin(impl.plugin_name)
        try:
            found: list[Any] = list(cast(Iterable[Any], impl.function()))
            bad = [t for t in found if not isinstance(t, EngineTarget)]
            if bad:
                raise TypeError(f"kvcore_engine_targets must return EngineTarget records, got {bad[0]!r}")
        except Exception as exc:  # one integration's bug must not hide the others' targets
            failures.append(PluginFailure(impl.plugin_name, origin.distribution if origin else "?",
                                          f"engine targets failed: {type(exc).__name__}: {exc}"))
            continue
        targets.extend(found)
    return sorted(targets, key=lambda t: (t.engine, t.name)), failures

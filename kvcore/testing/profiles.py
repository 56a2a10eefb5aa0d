"""How hard the conformance kit's hypothesis runs push: one profile per kind of run.

``KVCORE_HYPOTHESIS_PROFILE`` picks it (default ``dev``)::

    pytest plugins/radix/tests/test_conformance.py                                # dev: quick
    KVCORE_HYPOTHESIS_PROFILE=ci   pytest ...                                     # CI: twice the examples
    KVCORE_HYPOTHESIS_PROFILE=long pytest -k state_machine ...                    # a long fuzz run

A profile scales the kit's state machines (``examples x state_machine_examples``,
``steps x state_machine_steps``) and is also registered with hypothesis as
``kvcore-<name>`` and loaded when the variable is set, so ``@given`` tests that
use hypothesis' default settings scale with it too.  Unset, nothing is loaded:
a test suite that imports the kit keeps its own hypothesis settings.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import hypothesis

__all__ = ["PROFILE_ENV", "Profile", "PROFILES", "current_profile", "state_machine_settings", "load_profile"]

PROFILE_ENV = "KVCORE_HYPOTHESIS_PROFILE"


@dataclass(frozen=True)
class Profile:
    name: str
    #: multiplies a state machine's ``max_examples``
    examples: float
    #: multiplies a state machine's ``stateful_step_count``
    steps: float
    #: hypothesis' own ``max_examples`` for plain ``@given`` tests (``kvcore-<name>`` profile)
    max_examples: int
    #: a fixed seed per test (reproducible); the long profile explores instead
    derandomize: bool


PROFILES: dict[str, Profile] = {
    "dev": Profile("dev", examples=1, steps=1, max_examples=100, derandomize=True),
    "ci": Profile("ci", examples=2, steps=1, max_examples=200, derandomize=True),
    "long": Profile("long", examples=25, steps=2, max_examples=5000, derandomize=False),
}


def current_profile() -> Profile:
    """The profile ``KVCORE_HYPOTHESIS_PROFILE`` names (``dev`` when unset); an unknown name is an error."""
    name = os.environ.get(PROFILE_ENV, "").strip() or "dev"
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"{PROFILE_ENV}={name!r}: choose one of {', '.join(PROFILES)}") from None


def state_machine_settings(examples: int, steps: int) -> hypothesis.settings:
    """Hypothesis settings for a kit state machine of ``examples`` x ``steps`` at the ``dev`` profile."""
    from hypothesis import HealthCheck, settings

    prof = current_profile()
    return settings(
        max_examples=max(1, int(examples * prof.examples)),
        stateful_step_count=max(1, int(steps * prof.steps)),
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=prof.derandomize,
    )


_registered = False


def load_profile() -> Profile:
    """Register the ``kvcore-*`` hypothesis profiles and, when the variable is set, load the chosen one."""
    global _registered
    prof = current_profile()
    try:
        from hypothesis import HealthCheck, settings
    except ImportError:  # pragma: no cover - hypothesis is a test dependency
        return prof
    if not _registered:
        for p in PROFILES.values():
            settings.register_profile(
                f"kvcore-{p.name}",
                max_examples=p.max_examples,
                derandomize=p.derandomize,
                deadline=None if p.name == "long" else 2000,
                suppress_health_check=[HealthCheck.too_slow],
            )
        _registered = True
    if os.environ.get(PROFILE_ENV, "").strip():
        settings.load_profile(f"kvcore-{prof.name}")
    return prof

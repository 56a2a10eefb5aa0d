"""Exceptions kvcore raises on bad input and broken invariants."""

from __future__ import annotations

__all__ = ["KvcoreError", "InvariantViolation", "BackendNotFound", "PluginError", "DeviceUnavailable"]


class KvcoreError(Exception):
    """Base class of kvcore's own errors."""


class InvariantViolation(KvcoreError, AssertionError):
    """A pool lost a slot, freed one twice, or hands out one that someone owns."""


class BackendNotFound(KvcoreError, LookupError):
    """No backend of that name is registered."""


class PluginError(KvcoreError):
    """A plugin failed to load or registered something invalid."""


class DeviceUnavailable(KvcoreError, RuntimeError):
    """The requested device (cuda, npu) is not present here."""

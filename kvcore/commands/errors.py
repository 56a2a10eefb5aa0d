"""How the ``kvcore`` command ends: its exit codes, one line for a user's error, a traceback for a bug.

Exit codes (docs/bench.md and the README's CLI section list them):

- 0: done.
- 1 (:data:`EXIT_RUNTIME`): the command could not be done here: a device not usable here
  (or not registered), a plugin that failed to load (``kvcore backends``), pools too small
  for the workload, a fuzz failure, a file that could not be written, or a bug (then with
  its traceback).
- 2 (:data:`EXIT_USAGE`): the command line asks for something invalid: an option's value,
  an unknown backend or workload, an option no backend of the run takes, a backend option
  its config refuses, a trace file that is missing or malformed.
- 3 (:data:`EXIT_LEAK`): ``kvcore bench`` ran, but a backend leaked slots or rows or broke an
  invariant (the report is printed; one line per failing backend on stderr).

User errors are one line on stderr (``kvcore: error: ...``).  Any other exception is a bug:
its traceback goes to stderr, then one line naming the backend that was running and where the
exception was raised (a backend's distribution when the innermost frame of the traceback is
in a backend's package, else kvcore: a backend that refuses a wrong argument from kvcore is
named as the place, not as the culprit).  ``KVCORE_DEBUG=1`` shows the traceback of a user error too.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
import traceback
from collections.abc import Iterator

from pydantic import ValidationError

from kvcore.errors import DeviceUnavailable, KvcoreError, PluginError

__all__ = ["EXIT_OK", "EXIT_RUNTIME", "EXIT_USAGE", "EXIT_LEAK", "UsageError", "usage_phase", "running_backend",
           "report_exception", "DEBUG_ENV"]

EXIT_OK = 0
EXIT_RUNTIME = 1
EXIT_USAGE = 2
EXIT_LEAK = 3
DEBUG_ENV = "KVCORE_DEBUG"

# The exception that last escaped a running_backend block, and that backend's name.
_escaped: list[tuple[BaseException, str]] = []


class UsageError(KvcoreError, ValueError):
    """The command line asks for something invalid (exit status 2); the message names the option."""


@contextlib.contextmanager
def usage_phase() -> Iterator[None]:
    """Errors raised while a command checks its options and prepares its run are usage errors.

    kvcore's own errors (but a device or a plugin that is not usable here), bad values
    (ValueError, a pydantic error) and files that cannot be read; anything else still
    propagates as it is (a KeyError from a backend's code is a bug, not a usage error).
    """
    try:
        yield
    except (UsageError, DeviceUnavailable, PluginError):
        raise
    except (KvcoreError, ValueError, OSError) as exc:
        raise UsageError(str(exc)) from exc


@contextlib.contextmanager
def running_backend(name: str) -> Iterator[None]:
    """Name the backend that is running, for the report of a bug that escapes."""
    try:
        yield
    except BaseException as exc:
        _escaped[:] = [(exc, name)]
        raise


def _is_bug(exc: BaseException) -> BaseException | None:
    """The exception to report as a bug, or None for a user's error.

    A ConfigError that ``create_cache`` made of a TypeError in a backend's constructor is
    the backend's bug, not a bad option: the TypeError is reported.
    """
    from kvcore.factory import ConfigError

    if isinstance(exc, ConfigError):
        cause = exc.__cause__
        if cause is not None and not isinstance(cause, (KvcoreError, ValueError)):
            return cause
        return None
    if isinstance(exc, (KvcoreError, ValidationError, OSError)):
        return None
    return exc


def _where(exc: BaseException) -> str:
    """Whose code raised ``exc``: a backend's distribution when the innermost frame in a backend's
    package raised it, else kvcore."""
    from importlib.metadata import packages_distributions

    from kvcore.plugins import available_backends

    owners: dict[str, list[str]] = {}  # distribution -> its backends
    packages: dict[str, set[str]] = {}  # top-level package -> distributions
    for spec in available_backends().values():
        if spec.distribution == "kvcore":  # the built-in chunk backend: kvcore's own code
            continue
        owners.setdefault(spec.distribution, []).append(spec.name)
        module = inspect.getmodule(spec.factory)
        if module is not None:
            packages.setdefault(module.__name__.split(".")[0], set()).add(spec.distribution)
    if owners:
        for package, dists in packages_distributions().items():
            packages.setdefault(package, set()).update(d for d in dists if d in owners)
        for frame, lineno in reversed(list(traceback.walk_tb(exc.__traceback__))):
            package = str(frame.f_globals.get("__name__", "")).split(".")[0]
            for dist in sorted(packages.get(package, ())):
                names = ", ".join(owners[dist])
                return f"backend {names} (distribution {dist}, {frame.f_code.co_filename}:{lineno})"
    return "kvcore"


def report_exception(exc: BaseException) -> int:
    """Print ``exc`` as the CLI shows it; returns the exit status."""
    from kvcore.factory import ConfigError

    debug = os.environ.get(DEBUG_ENV, "") not in ("", "0")
    bug = _is_bug(exc)
    if bug is None:
        if debug:
            traceback.print_exception(exc, file=sys.stderr)
        print(f"kvcore: error: {exc}", file=sys.stderr)
        usage = isinstance(exc, (UsageError, ValidationError)) or (
            isinstance(exc, ConfigError) and exc.__cause__ is None)
        return EXIT_USAGE if usage else EXIT_RUNTIME
    traceback.print_exception(bug, file=sys.stderr)
    running = next((name for escaped, name in _escaped if escaped is exc or escaped is bug), None)
    during = f" while running backend {running!r}" if running else ""
    print(f"kvcore: internal error{during}: {type(bug).__name__}: {bug}. This is a bug, not a usage error: it was "
          f"raised in {_where(bug)}; please report it with the traceback above.", file=sys.stderr)
    return EXIT_RUNTIME

"""A backend's options as a CLI user types and reads them: ``--backend-opt key=value`` and ``kvcore backends``.

Values are typed the way a shell user writes them: JSON when the text parses as
JSON (``4``, ``true``, ``null``, ``["full", "swa"]``), a comma list becomes a list
(``components=full,swa``), anything else is a string (``eviction_policy=lfu``).
The backend's own config model then validates them, as ``create_cache`` would.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import BaseModel, ValidationError

from kvcore.config import did_you_mean
from kvcore.errors import KvcoreError

__all__ = ["OptionError", "parse_backend_opts", "parse_value", "describe_options", "format_validation_error"]


class OptionError(KvcoreError, ValueError):
    """A command-line option is malformed or does not fit: the message names the option."""


def parse_value(text: str) -> Any:
    """``"4"`` -> 4, ``"true"`` -> True, ``"full,swa"`` -> ["full", "swa"], ``"lfu"`` -> "lfu"."""
    try:
        return json.loads(text)
    except ValueError:
        pass
    if "," in text:
        return [part.strip() for part in text.split(",") if part.strip()]
    return text


def parse_backend_opts(items: Iterable[str], flag: str = "--backend-opt") -> list[tuple[str | None, str, Any]]:
    """``[BACKEND:]key=value`` items -> (backend or None for every backend, key, value), in the order given.

    A key named twice for the same backend is refused (the later one would silently win).
    """
    out: list[tuple[str | None, str, Any]] = []
    seen: set[tuple[str | None, str]] = set()
    for item in items:
        target, sep, value = item.partition("=")
        if not sep:
            raise OptionError(f"{flag} {item!r}: write key=value (or BACKEND:key=value), e.g. {flag} top_k=1024")
        backend, colon, key = target.strip().rpartition(":")
        key = key.strip()
        if not key.isidentifier():
            raise OptionError(f"{flag} {item!r}: {key!r} is not an option name")
        name = backend.strip() if colon else None
        if (name, key) in seen:
            raise OptionError(f"{flag} {item!r}: {key!r} is given twice{f' for {name}' if name else ''}")
        seen.add((name, key))
        out.append((name, key, parse_value(value.strip())))
    return out


def format_validation_error(exc: ValidationError, flags: Mapping[str, str], what: str = "",
                            known: Iterable[str] = ()) -> str:
    """One line for a pydantic error: each field named by the option the user typed (``flags[field]``);
    an unknown option gets the nearest of ``known`` as a did-you-mean."""

    parts = []
    for err in exc.errors():
        loc = [str(p) for p in err["loc"]]
        field = loc[0] if loc else ""
        message = err["msg"].removeprefix("Value error, ")
        if not field:
            parts.append(message)
            continue
        opt = flags.get(field, f"option {field!r}")
        if err["type"] == "extra_forbidden":
            parts.append(f"unknown option {field!r}{did_you_mean(field, known)}")
        else:
            parts.append(f"{opt}: {message} (got {err.get('input')!r})")
    return (f"{what}: " if what else "") + "; ".join(parts)


def _type_name(annotation: Any) -> str:
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation).replace("typing.", "")


def describe_options(config: type[BaseModel]) -> list[dict[str, Any]]:
    """Each option of ``config``: name, type, default (JSON-safe) and description, in declaration order."""
    out = []
    for name, field in config.model_fields.items():
        default = None if field.is_required() else field.get_default(call_default_factory=True)
        if isinstance(default, BaseModel):
            default = default.model_dump(mode="json")
        try:
            json.dumps(default)
        except TypeError:
            default = repr(default)
        out.append({
            "name": name,
            "type": _type_name(field.annotation),
            "required": field.is_required(),
            "default": default,
            "description": field.description or "",
        })
    return out

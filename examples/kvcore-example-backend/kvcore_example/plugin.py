"""Entry point ``example`` in group ``kvcore``: registers the ``example`` backend."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvcore import hookimpl
from kvcore_example.cache import ExampleCache, ExampleConfig


@hookimpl
def kvcore_register_backends(register: Callable[..., Any]) -> None:
    register(
        "example",
        ExampleCache,
        config=ExampleConfig,
        description="The guide's example: a small radix tree on kvcore.tree (docs/writing-a-backend.md)",
        reference="radix",
    )

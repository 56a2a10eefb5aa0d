"""Options of the ``example-component`` backend: the core's one tree with components (full, stamp)."""

from __future__ import annotations

from pydantic import Field

from kvcore.tree.unified_config import UnifiedConfig
from kvcore_example_component.component import StampOptions

__all__ = ["ExampleComponentConfig"]

_LIMIT = StampOptions.model_fields["stamp_limit"]


class ExampleComponentConfig(UnifiedConfig):
    """Options of ``example-component``: the tree's, plus the ``stamp`` component's ``stamp_limit``.

    ``stamp_limit`` is declared here (with the component's default) so that generic tools
    (``kvcore backends``, ``kvcore bench``) list it; the component's own model validates it.
    """

    component_set = ("full", "stamp")
    policy_backend = "example-component"
    policy_reason = "each component keeps its own LRU order (full slots and stamps), as SGLang's UnifiedRadixCache"

    components: tuple[str, ...] = Field(("full", "stamp"), description="the component set: ('full', 'stamp') only")
    stamp_limit: int = Field(_LIMIT.default, description=_LIMIT.description)

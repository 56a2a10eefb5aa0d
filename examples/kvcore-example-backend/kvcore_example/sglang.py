"""The example backend as an SGLang ``--radix-cache-backend`` name: ``kvcore-example``.

Declared in this distribution's ``pyproject.toml`` (entry-point group ``kvcore_sglang.targets``);
kvcore-sglang registers the name from that metadata in every SGLang scheduler process and loads
this module only when SGLang builds the cache.  Importing it needs kvcore-sglang (pydantic
only), not SGLang.
"""

from __future__ import annotations

from kvcore_sglang import Target

__all__ = ["TARGET"]

TARGET = Target(
    name="kvcore-example",
    backend="example",
    serves=("full",),
    description="the author guide's example radix tree (SGLang's RadixCache) for full-attention models",
)

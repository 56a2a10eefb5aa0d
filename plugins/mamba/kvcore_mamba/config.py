"""Options of the ``mamba`` backend: the core's one tree with components (full, mamba)."""

from __future__ import annotations

from pydantic import Field

from kvcore.pools.mamba_pool import MambaStateOptions
from kvcore.tree.unified_config import UnifiedConfig

__all__ = ["MambaConfig"]


class MambaConfig(UnifiedConfig, MambaStateOptions):
    """Options of the ``mamba`` backend (SGLang's UnifiedRadixCache with components full + mamba).

    On top of the common pool options: ``mamba_size`` state slots (default four per
    request row), ``mamba_cache_chunk_size`` (where a branching state snapshot is
    taken, 64) and the state shapes: ``mamba_num_layers`` Mamba layers, each with one
    conv state per entry of ``mamba_conv_shapes`` and one temporal (SSM) state of
    ``mamba_temporal_shape``, in ``mamba_dtype``.  Small defaults; the bench raises
    them to a real model's.  They are the ``mamba`` component's options
    (:class:`kvcore_mamba.component.MambaOptions`), declared here for generic tools.

    ``page_size > 1`` runs SGLang's extra-buffer mode: every request also holds two
    ping-pong tracking slots, prefill keeps a snapshot at chunk boundaries and decode
    one every ``mamba_track_interval`` tokens (rounded to the chunk), and only those
    snapshots go into the tree.  ``mamba_cache_chunk_size`` must then be a multiple of
    ``page_size``.
    """

    component_set = ("full", "mamba")
    policy_backend = "mamba"
    policy_reason = "each component keeps its own LRU order (full and state), as SGLang's UnifiedRadixCache"

    components: tuple[str, ...] = Field(("full", "mamba"), description="the component set: ('full', 'mamba') only")

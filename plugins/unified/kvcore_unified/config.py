"""Options of ``unified-swa`` and ``unified-mamba``: ``unified`` with a component set by default."""

from __future__ import annotations

from pydantic import Field

from kvcore.tree.unified_config import UnifiedConfig

__all__ = ["UnifiedMambaConfig", "UnifiedSWAConfig"]


class UnifiedSWAConfig(UnifiedConfig):
    """``unified-swa``: ``unified`` with components (full, swa) by default, the window options declared.

    The same backend as ``unified``; declaring the window options lets generic tools
    (``kvcore bench``) see that it takes them.
    """

    policy_backend = "unified-swa"

    components: tuple[str, ...] = Field(("full", "swa"), description="tree components, full first")
    sliding_window_size: int = Field(1024, description="attention window W in tokens (the swa component's)")
    swa_size: int | None = Field(None, description="window-pool token slots (default: size; the swa component's)")


class UnifiedMambaConfig(UnifiedConfig):
    """``unified-mamba``: ``unified`` with components (full, mamba) by default."""

    policy_backend = "unified-mamba"

    components: tuple[str, ...] = Field(("full", "mamba"), description="tree components, full first")

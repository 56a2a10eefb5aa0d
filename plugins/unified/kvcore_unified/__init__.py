"""kvcore-unified: SGLang's UnifiedRadixCache -- one radix tree whose nodes carry pluggable components."""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version

from kvcore_unified.components import FullComponent, SWAComponent
from kvcore_unified.config import UnifiedConfig, UnifiedMambaConfig, UnifiedSWAConfig
from kvcore_unified.mamba import MambaComponent
from kvcore_unified.tree import UnifiedNode, UnifiedRadixCache

try:
    __version__ = _version("kvcore-unified")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0"

__all__ = [
    "FullComponent",
    "MambaComponent",
    "SWAComponent",
    "UnifiedConfig",
    "UnifiedMambaConfig",
    "UnifiedNode",
    "UnifiedRadixCache",
    "UnifiedSWAConfig",
    "__version__",
]

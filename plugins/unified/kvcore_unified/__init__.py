"""kvcore-unified: the ``unified`` backend (SGLang's UnifiedRadixCache) on the core's one component tree."""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version

from kvcore_unified.config import UnifiedMambaConfig, UnifiedSWAConfig

try:
    __version__ = _version("kvcore-unified")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0"

__all__ = ["UnifiedMambaConfig", "UnifiedSWAConfig", "__version__"]

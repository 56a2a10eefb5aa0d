"""kvcore-radix: the ``radix`` prefix-cache backend for kvcore (SGLang RadixCache semantics).

``radix`` is the core tree (:mod:`kvcore.tree.unified`) as the component set
``("full",)`` with RadixCache's answers; this package holds its options and its
registration.  ``RadixCache`` and ``TreeNode`` name the core's tree and node classes.
"""

from importlib.metadata import version

from kvcore.tree.unified import UnifiedNode as TreeNode
from kvcore.tree.unified import UnifiedRadixCache as RadixCache
from kvcore_radix.config import RadixConfig

__version__ = version("kvcore-radix")

__all__ = ["RadixCache", "RadixConfig", "TreeNode", "__version__"]

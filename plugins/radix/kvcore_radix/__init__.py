"""kvcore-radix: the ``radix`` prefix-cache backend for kvcore (SGLang RadixCache semantics).

The tree machinery (node splits, lock walks, KV events, eviction policies) is
kvcore's public tree kit, :mod:`kvcore.tree`.
"""

from importlib.metadata import version

from kvcore_radix.config import RadixConfig
from kvcore_radix.radix_cache import RadixCache, TreeNode

__version__ = version("kvcore-radix")

__all__ = ["RadixCache", "RadixConfig", "TreeNode", "__version__"]

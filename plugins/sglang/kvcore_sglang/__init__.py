"""kvcore-sglang: kvcore's prefix-cache backends selectable in SGLang with ``--radix-cache-backend``.

Importing this package imports neither SGLang nor torch: the entry point
(:func:`kvcore_sglang.plugin.register_with_sglang`) registers factories that
import the version module for the running SGLang (``kvcore_sglang.v0_5_19``) only
when SGLang builds its tree cache.
"""

from importlib.metadata import version

from kvcore_sglang.config import TARGETS, Target

__version__ = version("kvcore-sglang")

__all__ = ["TARGETS", "Target", "__version__"]

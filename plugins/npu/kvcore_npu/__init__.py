"""kvcore-npu: the Ascend ``npu`` device and the ``npu`` backend (SGLang 0.5.19's NPU pools).

Importing this package never imports ``torch_npu``: the device resolves it when a
cache is built on ``device="npu"``, the K/V pool when it writes through its ops.
The pools are plain torch code, so on ``device="cpu"`` the same allocator
(int32 results, page 128) and 5-D K/V layout run for tests.
"""

from importlib.metadata import version

from kvcore_npu.allocator import NPUPagedTokenToKVPoolAllocator
from kvcore_npu.cache import build_npu_cache
from kvcore_npu.config import NpuConfig, NpuPools
from kvcore_npu.memory_pool import NPUMHATokenToKVPool

__version__ = version("kvcore-npu")

__all__ = [
    "NPUMHATokenToKVPool", "NPUPagedTokenToKVPoolAllocator", "NpuConfig", "NpuPools", "build_npu_cache", "__version__",
]

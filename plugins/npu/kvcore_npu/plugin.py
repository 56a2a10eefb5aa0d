"""Entry point of kvcore-npu (group ``kvcore``): device ``npu`` and backend ``npu``.

Nothing here imports torch_npu: the device's ``why_unavailable`` only looks for it.
"""

from collections.abc import Callable

from kvcore import hookimpl
from kvcore_npu import device
from kvcore_npu.allocator import NPUPagedTokenToKVPoolAllocator
from kvcore_npu.cache import build_npu_cache
from kvcore_npu.config import NpuConfig, NpuPools
from kvcore_npu.memory_pool import NPUMHATokenToKVPool


@hookimpl
def kvcore_register_devices(register: Callable[..., None]) -> None:
    register(
        "npu",
        why_unavailable=device.why_unavailable,
        resolve=device.resolve,
        allocator=NPUPagedTokenToKVPoolAllocator,
        kv_pool=NPUMHATokenToKVPool,
        defaults={"page_size": 128},
        synchronize=device.synchronize,
        page_aligned_sessions=True,
        description="Huawei Ascend NPUs through torch_npu (npu, npu:N): SGLang's NPU allocator and 5-D K/V pool",
    )


@hookimpl
def kvcore_register_backends(register: Callable[..., None]) -> None:
    register(
        "npu",
        build_npu_cache,
        config=NpuConfig,
        pools=NpuPools(),
        description="The radix tree on SGLang's NPU pools: page 128, int32 batch slots, 5-D K/V buffer "
        "(runs on device cpu too)",
        reference="radix",
    )

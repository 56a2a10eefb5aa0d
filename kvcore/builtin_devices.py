"""The core's own device kinds, ``cpu`` and ``cuda``, registered through ``kvcore_register_devices``.

Both run kvcore's own pools (:class:`kvcore.pools.TokenToKVPoolAllocator`,
:class:`kvcore.pools.MHATokenToKVPool`); other kinds come from plugins (kvcore-npu
registers ``npu``) the same way.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvcore.errors import DeviceUnavailable
from kvcore.hookspecs import hookimpl


def _cpu_available() -> str | None:
    return None


def _cpu_resolve(text: str) -> torch.device:
    dev = torch.device(text)
    if dev.type != "cpu":
        raise DeviceUnavailable(f"device {text!r} is not a cpu device")
    return dev


def _cuda_available() -> str | None:
    # torch is already imported by kvcore; is_available() does not create a CUDA context.
    if not torch.cuda.is_available():
        return f"CUDA is not available here (torch {torch.__version__})"
    return None


def _cuda_resolve(text: str) -> torch.device:
    dev = torch.device(text)
    if dev.type != "cuda":
        raise DeviceUnavailable(f"device {text!r} is not a cuda device")
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        raise DeviceUnavailable(f"device {text!r} requested but only {count} CUDA device(s) exist")
    return dev


def _cuda_synchronize(device: torch.device) -> None:
    torch.cuda.synchronize(device)


@hookimpl
def kvcore_register_devices(register: Callable[..., None]) -> None:
    register(
        "cpu", why_unavailable=_cpu_available, resolve=_cpu_resolve, description="host memory, torch's CPU tensors"
    )
    register(
        "cuda",
        why_unavailable=_cuda_available,
        resolve=_cuda_resolve,
        synchronize=_cuda_synchronize,
        description="NVIDIA GPUs through torch.cuda (cuda, cuda:N)",
    )

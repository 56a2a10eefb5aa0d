"""Device checks that name what is missing, without importing torch_npu eagerly."""

from __future__ import annotations

import importlib
import importlib.util

import torch

from kvcore.errors import DeviceUnavailable

__all__ = ["check_device", "synchronize"]


def check_device(device: str | torch.device) -> torch.device:
    """Return ``device`` as a torch.device, or raise DeviceUnavailable saying what is missing."""
    text = str(device)
    # torch only knows "npu" once torch_npu is imported, so check for it by name first.
    if text == "npu" or text.startswith("npu:"):
        if importlib.util.find_spec("torch_npu") is None:
            raise DeviceUnavailable(
                f"device {text!r} requested but torch_npu is not installed; "
                "install torch-npu and the Ascend CANN toolkit"
            )
        importlib.import_module("torch_npu")
        if not torch.npu.is_available():  # type: ignore[attr-defined]
            raise DeviceUnavailable(f"device {text!r} requested but torch_npu finds no Ascend NPU")
        return torch.device(text)
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise DeviceUnavailable(f"unknown device {text!r}: use cpu, cuda, cuda:N or npu") from None
    if dev.type == "cpu":
        return dev
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceUnavailable(
                f"device {device!r} requested but CUDA is not available here (torch {torch.__version__})"
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise DeviceUnavailable(
                f"device {device!r} requested but only {torch.cuda.device_count()} CUDA device(s) exist"
            )
        return dev
    raise DeviceUnavailable(f"device type {dev.type!r} is not supported; use cpu, cuda or npu")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "npu":
        torch.npu.synchronize(device)  # type: ignore[attr-defined]

"""Device kind ``npu``: availability without importing torch_npu, resolution with it.

``torch_npu`` is Huawei's PyTorch adapter for Ascend; importing it registers the
``npu`` device type (``torch.device("npu:0")``) and ``torch_npu.npu`` (the
``torch.cuda`` look-alike).  It is imported only by :func:`resolve` and
:func:`synchronize`, i.e. when a cache is really built or timed on an NPU, and by
:class:`kvcore_npu.NPUMHATokenToKVPool` when it writes through its ops.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from types import ModuleType

import torch

from kvcore import DeviceUnavailable

__all__ = ["INSTALL_HINT", "torch_npu", "why_unavailable", "resolve", "synchronize"]

INSTALL_HINT = "pip install torch-npu, which needs the Ascend CANN toolkit"


def why_unavailable() -> str | None:
    """None when torch_npu can be imported here, else why not.  Imports nothing (``find_spec``)."""
    if sys.modules.get("torch_npu") is not None:
        return None
    try:
        found = importlib.util.find_spec("torch_npu") is not None
    except (ImportError, ValueError):
        found = False
    return None if found else f"torch_npu is not installed ({INSTALL_HINT})"


def torch_npu() -> ModuleType:
    """Import torch_npu now (the one place the plugin does), or DeviceUnavailable naming it."""
    try:
        return importlib.import_module("torch_npu")
    except ImportError as exc:
        raise DeviceUnavailable(f"torch_npu cannot be imported: {exc} ({INSTALL_HINT})") from None


def resolve(text: str) -> torch.device:
    """``"npu"`` / ``"npu:N"`` as a torch.device once torch_npu is imported and finds that NPU."""
    kind, _, index = text.partition(":")
    if kind != "npu" or (index and not index.isdigit()):
        raise DeviceUnavailable(f"device {text!r} is not an npu device: use npu or npu:N")
    npu = torch_npu().npu
    if not npu.is_available():
        raise DeviceUnavailable(f"device {text!r}: torch_npu is installed but finds no Ascend NPU here")
    count = int(npu.device_count())
    if index and int(index) >= count:
        raise DeviceUnavailable(f"device {text!r} requested but only {count} Ascend NPU(s) exist")
    return torch.device(text)


def synchronize(device: torch.device) -> None:
    torch_npu().npu.synchronize(device)

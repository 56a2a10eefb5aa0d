"""Load SGLang's own ``DecodeReqToTokenPool`` (``srt/disaggregation/decode.py``) on the CPU.

    from tools.sglang_decode_shim import load_decode_req_to_token_pool
    Pool = load_decode_req_to_token_pool("/tmp/sgl/src")
    pool = Pool(size=4, max_context_len=8, device="cpu", enable_memory_saver=False, pre_alloc_size=2)

``decode.py`` imports the whole disaggregation stack (transfer engines, the
scheduler); only the class is needed, so :func:`tools.sglang_loader.lift` lifts it
from the file (as the loader lifts ``ReqToTokenPool``) into a namespace holding
torch and a stub for the memory-saver adapter.  Nothing is copied into this repository.
"""

from __future__ import annotations

from typing import Any

import torch

from tools.sglang_loader import Stub, lift, srt_path

__all__ = ["load_decode_req_to_token_pool"]


def load_decode_req_to_token_pool(src: str) -> type:
    """SGLang's ``DecodeReqToTokenPool`` class, executed from ``src``."""
    ns: dict[str, Any] = dict(torch=torch, TorchMemorySaverAdapter=Stub("TorchMemorySaverAdapter"),
                              GPU_MEMORY_TYPE_KV_CACHE="kv_cache")
    return lift(srt_path(src, "disaggregation", "decode.py"), ["DecodeReqToTokenPool"], ns)["DecodeReqToTokenPool"]

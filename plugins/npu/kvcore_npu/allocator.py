"""SGLang 0.5.19's ``NPUPagedTokenToKVPoolAllocator`` semantics on kvcore's paged allocator.

What differs from :class:`kvcore.pools.TokenToKVPoolAllocator` (SGLang's CUDA
``PagedTokenToKVPoolAllocator``), as in SGLang's NPU subclass:

* ``alloc_extend`` and ``alloc_decode`` return **int32** slot ids (SGLang ends both
  with ``.int()``); plain ``alloc`` stays int64 (inherited there too).  The engine
  writes them into the int32 ``req_to_token`` rows, the tree converts row slices to
  int64 when it inserts, and the NPU K/V write op takes int32 slot indices.
* ``alloc_extend`` gives SGLang's *naive* path's slots (per request, the rest of the
  last partial page, then whole pages, then the tail page), laid out from the host
  lengths.  That is the base class's rule (:mod:`kvcore.pools.batch_alloc`), which
  already works request by request from ``prefix_lens_cpu`` / ``seq_lens_cpu``;
  SGLang runs an NPU Triton kernel below 200 new pages that gives the same slots.
* ``free`` makes the page ids unique **on the host** (SGLang's NPU subclass avoids
  a device ``unique``) and, as SGLang does when paged, puts them at the front of
  the free list: on an NPU the pool runs in :class:`NPUTorchOps`.

The free list, argument checks, ownership claims, segment frees and groups are the
base class's.  With ``page_size == 1`` (never used with this class in SGLang)
everything is the base class's.
"""

from __future__ import annotations

import torch

from kvcore.pools import TokenToKVPoolAllocator
from kvcore.pools.alloc_args import SlotRequest
from kvcore.pools.array_ops import TorchOps, ops_for

__all__ = ["NPUPagedTokenToKVPoolAllocator", "NPUTorchOps"]


class NPUTorchOps(TorchOps):
    """Torch on the NPU, with ``unique`` on the host as SGLang's NPU free does."""

    def unique(self, a: torch.Tensor) -> torch.Tensor:
        return torch.unique(a.cpu()).to(a.device)


class NPUPagedTokenToKVPoolAllocator(TokenToKVPoolAllocator):
    """Paged token-slot allocator with SGLang's NPU behaviour (see the module docstring)."""

    def __init__(self, size: int, page_size: int = 1, device: str | torch.device = "cpu") -> None:
        cpu = torch.device(device).type == "cpu"
        super().__init__(size, page_size, device, array_ops=ops_for(device) if cpu else NPUTorchOps(device))

    def alloc_checked(self, req: SlotRequest) -> torch.Tensor | None:
        out = super().alloc_checked(req)
        return None if out is None else out.to(torch.int32)

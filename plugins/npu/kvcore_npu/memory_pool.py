"""SGLang 0.5.19's NPU K/V layout (``NPUMHATokenToKVPool``): one 5-D buffer each for K and V.

Shape ``(layer_num, size // page_size + 1, page_size, head_num, head_dim)``: page 0
is padding, slot ``s`` lives at ``[layer, s // page_size, s % page_size]``, and the
whole cache is one contiguous tensor (what Ascend's transfer backends want).

K/V writes go through ``torch_npu._npu_reshape_and_cache`` (SGLang's non-FIA path:
``key_cache``/``value_cache`` viewed as ``(-1, page_size, heads, head_dim)``, int32
``slot_indices``) when the buffer lives on an NPU, and through plain indexing of a
``(-1, heads, head_dim)`` view otherwise (the CPU, CUDA).  ``use_npu_ops`` forces
either path; torch_npu is imported on the first write that uses it, never before.
"""

from __future__ import annotations

from types import ModuleType

import torch

from kvcore.pools import MHATokenToKVPool

__all__ = ["NPUMHATokenToKVPool"]


class NPUMHATokenToKVPool(MHATokenToKVPool):
    """K and V of every layer in one 5-D buffer each (see the module docstring)."""

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        head_num: int,
        head_dim: int,
        layer_num: int,
        device: str | torch.device,
        *,
        use_npu_ops: bool | None = None,
    ) -> None:
        super().__init__(size, page_size, dtype, head_num, head_dim, layer_num, device)
        self.use_npu_ops = self.k_buffer.device.type == "npu" if use_npu_ops is None else bool(use_npu_ops)
        self._ops: ModuleType | None = None

    def _make_buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        # Called after the base class checked that every size is positive.
        if self.size % self.page_size:
            raise ValueError(f"size={self.size} must be a multiple of page_size={self.page_size}")
        shape = (self.layer_num, self.size // self.page_size + 1, self.page_size, self.head_num, self.head_dim)
        return (torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device))

    def set_kv_buffer(
        self, layer_id: int, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor
    ) -> None:
        """Write ``cache_k``/``cache_v`` (``(n, heads, head_dim)``) at token slots ``loc`` of one layer."""
        cache_k = cache_k.to(self.dtype)
        cache_v = cache_v.to(self.dtype)
        h, d = self.head_num, self.head_dim
        if self.use_npu_ops:
            ops = self._ops
            if ops is None:
                from kvcore_npu.device import torch_npu

                ops = self._ops = torch_npu()
            ops._npu_reshape_and_cache(
                key=cache_k,
                value=cache_v,
                key_cache=self.k_buffer[layer_id].view(-1, self.page_size, h, d),
                value_cache=self.v_buffer[layer_id].view(-1, self.page_size, h, d),
                slot_indices=loc.to(torch.int32),
            )
            return
        self.k_buffer[layer_id].view(-1, h, d)[loc] = cache_k
        self.v_buffer[layer_id].view(-1, h, d)[loc] = cache_v


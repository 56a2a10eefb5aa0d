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

__all__ = ["NPUMHATokenToKVPool"]


class NPUMHATokenToKVPool:
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
        if size <= 0 or page_size <= 0 or head_num <= 0 or head_dim <= 0 or layer_num <= 0:
            raise ValueError(
                f"size={size}, page_size={page_size}, head_num={head_num}, head_dim={head_dim}"
                f" and layer_num={layer_num} must all be positive"
            )
        if size % page_size:
            raise ValueError(f"size={size} must be a multiple of page_size={page_size}")
        self.size = size
        self.page_size = page_size
        self.dtype = dtype
        self.head_num = head_num
        self.head_dim = head_dim
        self.layer_num = layer_num
        self.device = device
        shape = (layer_num, size // page_size + 1, page_size, head_num, head_dim)
        self.k_buffer = torch.zeros(shape, dtype=dtype, device=device)
        self.v_buffer = torch.zeros(shape, dtype=dtype, device=device)
        self.use_npu_ops = self.k_buffer.device.type == "npu" if use_npu_ops is None else bool(use_npu_ops)
        self._ops: ModuleType | None = None

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        """Layer ``layer_id``'s keys, ``(pages + 1, page_size, heads, head_dim)`` (SGLang's NPU shape)."""
        return self.k_buffer[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v_buffer[layer_id]

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffer[layer_id], self.v_buffer[layer_id]

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

    def mem_usage_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k_buffer, self.v_buffer))

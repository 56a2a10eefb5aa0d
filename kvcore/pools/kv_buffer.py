"""Per-layer K and V data buffers indexed by token slot."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["MHATokenToKVPool"]


class MHATokenToKVPool:
    """K and V of shape ``(size + page_size, head_num, head_dim)`` per layer; page 0 is padding."""

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        head_num: int,
        head_dim: int,
        layer_num: int,
        device: str | torch.device,
    ) -> None:
        if size <= 0 or page_size <= 0 or head_num <= 0 or head_dim <= 0 or layer_num <= 0:
            raise ValueError(
                f"size={size}, page_size={page_size}, head_num={head_num}, head_dim={head_dim}"
                f" and layer_num={layer_num} must all be positive"
            )
        self.size = size
        self.page_size = page_size
        self.dtype = dtype
        self.head_num = head_num
        self.head_dim = head_dim
        self.layer_num = layer_num
        self.device = device
        self.k_buffer, self.v_buffer = self._make_buffers()

    def _make_buffers(self) -> tuple[Any, Any]:
        """K and V, each indexable by layer; a device with another layout overrides this."""
        shape = (self.size + self.page_size, self.head_num, self.head_dim)
        k = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.layer_num)]
        v = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.layer_num)]
        return k, v

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k_buffer[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v_buffer[layer_id]

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffer[layer_id], self.v_buffer[layer_id]

    def set_kv_buffer(
        self, layer_id: int, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor
    ) -> None:
        self.k_buffer[layer_id][loc] = cache_k.to(self.dtype)
        self.v_buffer[layer_id][loc] = cache_v.to(self.dtype)

    def mem_usage_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k_buffer, *self.v_buffer))

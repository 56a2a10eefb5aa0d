"""K/V writes into the device buffer: every prefill chunk and decode step moves real bytes.

The :class:`KVWriter` is handed to :class:`kvcore.engine.Engine` as its
``kv_writer``; the engine calls it with each batch of slots it hands out.
"""

from __future__ import annotations

from time import perf_counter
from typing import Any

import torch

__all__ = ["KVWriter"]


class KVWriter:
    """Writes K and V of every new token into ``pool`` (``set_kv_buffer`` per layer) and counts the cost.

    ``pool`` is the cache's own KV buffer (built from the ``kv_buffer`` option);
    ``rows`` is the most tokens one call writes before the source is tiled.
    """

    def __init__(self, pool: Any, device: torch.device, *, rows: int):
        # What the buffer says it holds (MHATokenToKVPool's fields) sizes the source.
        self.pool = pool
        self.layers = int(pool.layer_num)
        heads, dim, dtype = int(pool.head_num), int(pool.head_dim), pool.dtype
        g = torch.Generator(device="cpu").manual_seed(0)
        self.src = torch.randn((rows, heads, dim), generator=g).to(dtype=dtype, device=device)
        self.token_bytes = 2 * self.layers * heads * dim * self.src.element_size()
        self.seconds = 0.0
        self.bytes_written = 0

    def __call__(self, slots: torch.Tensor) -> None:
        n = slots.numel()
        if n == 0:
            return
        t = perf_counter()
        k = self.src
        while n > k.shape[0]:
            k = torch.cat((k, k))
        for layer in range(self.layers):
            self.pool.set_kv_buffer(layer, slots, k[:n], k[:n])
        self.seconds += perf_counter() - t
        self.bytes_written += n * self.token_bytes


def make_kv_writer(cache: Any, device: torch.device, *, rows: int, layers: int, heads: int, head_dim: int) -> KVWriter:
    """A writer into ``cache``'s KV buffer (built from the ``kv_buffer`` option), or into a new
    ``MHATokenToKVPool`` over its first pool when the backend keeps none."""
    pool = cache.kv_pool
    if pool is None:
        from kvcore.pools import MHATokenToKVPool

        first = cache.pools()[0]
        pool = MHATokenToKVPool(first.capacity, cache.page_size, torch.float16, heads, head_dim, layers, device)
    return KVWriter(pool, device, rows=rows)

"""SGLang 0.5.19's ``NPUPagedTokenToKVPoolAllocator`` semantics on kvcore's paged allocator.

What differs from :class:`kvcore.pools.TokenToKVPoolAllocator` (SGLang's CUDA
``PagedTokenToKVPoolAllocator``), as in SGLang's NPU subclass:

* ``alloc_extend`` and ``alloc_decode`` return **int32** slot ids (SGLang ends both
  with ``.int()``); plain ``alloc`` stays int64 (inherited there too).  The engine
  writes them into the int32 ``req_to_token`` rows, the tree converts row slices to
  int64 when it inserts, and the NPU K/V write op takes int32 slot indices.
* ``alloc_extend`` always takes SGLang's *naive* path (``alloc_extend_naive``: per
  request, the rest of the last partial page, then whole pages, then the tail
  page).  SGLang runs an NPU Triton kernel (``sgl_kernel_npu``) below 200 new pages
  and the naive path above; there is no such kernel here, so the naive path runs
  for every size.  It loops over requests with host-side lengths
  (``prefix_lens_cpu`` / ``seq_lens_cpu``), so it never reads a device tensor back.
* ``alloc_decode`` is computed in torch (``seq_lens % page_size == 1`` marks the
  requests that start a page; SGLang uses the same expression on NPU, not a kernel).
* ``free`` makes the page ids unique **on the host** (SGLang's NPU subclass avoids
  a device ``unique``) and, as SGLang does when paged, puts them at the front of
  the free list.

The free list, validation, ownership claims, segment frees and groups are the
base class's.  With ``page_size == 1`` (never used with this class in SGLang)
everything is the base class's.
"""

from __future__ import annotations

from typing import Any

import torch

from kvcore.pools import TokenToKVPoolAllocator

__all__ = ["NPUPagedTokenToKVPoolAllocator"]


def _host_lens(x: Any) -> list[int]:
    if isinstance(x, torch.Tensor):
        return [int(v) for v in x.detach().to("cpu", torch.int64).reshape(-1).tolist()]
    return [int(v) for v in x]


class NPUPagedTokenToKVPoolAllocator(TokenToKVPoolAllocator):
    """Paged token-slot allocator with SGLang's NPU behaviour (see the module docstring)."""

    def alloc_extend(
        self,
        prefix_lens: Any,
        prefix_lens_cpu: Any,
        seq_lens: Any,
        seq_lens_cpu: Any,
        last_loc: Any,
        extend_num_tokens: int,
        num_new_pages: int | None = None,
    ) -> torch.Tensor | None:
        p = self.page_size
        if p == 1:
            return super().alloc_extend(
                prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens, num_new_pages
            )
        pre, seq = _host_lens(prefix_lens_cpu), _host_lens(seq_lens_cpu)
        if len(pre) != len(seq):
            raise ValueError(f"{len(pre)} prefix lengths but {len(seq)} sequence lengths")
        if any(b < a for a, b in zip(pre, seq)) or sum(seq) - sum(pre) != extend_num_tokens:
            raise ValueError(
                f"extend_num_tokens={extend_num_tokens} does not match seq_lens - prefix_lens"
                f" (sum {sum(seq) - sum(pre)}, all must be >= 0)"
            )
        if num_new_pages is None:
            num_new_pages = sum(-(-b // p) - -(-a // p) for a, b in zip(pre, seq))
        if num_new_pages > self._count:
            return None
        pages = self._peek(num_new_pages)
        dev = self.device
        last = torch.as_tensor(last_loc, dtype=torch.int64, device=dev).reshape(-1)
        pos = self._offsets
        out = torch.empty((extend_num_tokens,), dtype=torch.int32, device=dev)
        start = 0  # first output position of request i
        first_page = 0  # its first new page in `pages`
        for i, (a, b) in enumerate(zip(pre, seq)):
            n = b - a
            new_pages = -(-b // p) - -(-a // p)
            # 1. the rest of the last partial page, right after last_loc.
            num1 = min(b, -(-a // p) * p) - a
            if num1:
                out[start : start + num1] = last[i] + 1 + pos[:num1]
            if a + num1 < b:
                # 2. whole new pages.
                full = b // p - -(-a // p)
                if full > 0:
                    block = pages[first_page : first_page + full, None] * p + pos
                    out[start + num1 : start + num1 + full * p] = block.reshape(-1)
                # 3. the tail: the first slots of the last new page.
                num3 = b - b // p * p
                if a + num1 + max(full, 0) * p < b and num3:
                    out[start + n - num3 : start + n] = pages[first_page + new_pages - 1] * p + pos[:num3]
            start += n
            first_page += new_pages
        self._pop(pages)
        return out

    def alloc_decode(self, seq_lens: Any, seq_lens_cpu: Any, last_loc: Any) -> torch.Tensor | None:
        p = self.page_size
        if p == 1:
            return super().alloc_decode(seq_lens, seq_lens_cpu, last_loc)
        num_new_pages = self.num_new_pages_decode(seq_lens_cpu)
        if num_new_pages > self._count:
            return None
        pages = self._peek(num_new_pages)
        dev = self.device
        seq = torch.as_tensor(seq_lens, dtype=torch.int64, device=dev).reshape(-1)
        last = torch.as_tensor(last_loc, dtype=torch.int64, device=dev).reshape(-1)
        if num_new_pages == 0:
            out = last + 1
        else:
            need = (seq % p == 1).to(torch.int64)
            end = torch.cumsum(need, 0)
            first = (end - need).clamp(max=num_new_pages - 1)
            out = (last + 1) * (1 - need) + pages[first] * p * need
        self._pop(pages)
        return out.to(torch.int32)

    def free(self, free_index: Any) -> None:
        slots = self._as_slots(free_index)
        if slots.numel() == 0:
            return
        if self.page_size == 1 or self._group is not None:
            super().free(slots)
            return
        self._check_range(slots)
        # SGLang's NPU free: unique page ids computed on the host, then back on the device, at the front.
        pages = torch.unique(slots.cpu() // self.page_size).to(self.device)
        self._push(self._checked_page_ids(pages, commit=True))

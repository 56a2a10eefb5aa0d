"""One decode step's KV slots through SGLang's own allocation functions, for the request-path drivers.

Version-neutral: ``allocation.alloc_token_slots(tree_cache, n)`` and
``alloc_paged_token_slots_decode(tree_cache, seq_lens, seq_lens_cpu, last_loc)`` and the record
fields written here are the same in SGLang 0.5.19 and 0.5.23, so both drivers
(``sglang_request_path_shim``, ``sglang023_request_path``) take a decode step from here.
"""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.mem_cache import allocation

__all__ = ["alloc_decode_slots", "commit_decode"]


def alloc_decode_slots(cache: Any, req_to_token_pool: Any, page_size: int, reqs: list) -> torch.Tensor:
    """One new slot per request (evicting through ``evict_from_tree_cache`` as SGLang's allocation does)."""
    if page_size == 1:
        return allocation.alloc_token_slots(cache, len(reqs))
    seq = torch.tensor([r.kv.kv_committed_len + 1 for r in reqs])
    table = req_to_token_pool.req_to_token
    last = torch.stack([table[r.kv.req_pool_idx, r.kv.kv_committed_len - 1] for r in reqs])
    return allocation.alloc_paged_token_slots_decode(cache, seq, seq.clone(), last.to(torch.int64))


def commit_decode(req_to_token_pool: Any, reqs: list, slots: torch.Tensor, tokens: list[int]) -> list:
    """``write_cache_indices`` for the step and the record's lengths and output, as the scheduler leaves them."""
    out = slots.tolist()
    for req, slot, tok in zip(reqs, out, tokens):
        req_to_token_pool.req_to_token[req.kv.req_pool_idx, req.kv.kv_committed_len] = slot
        req.kv.kv_allocated_len += 1
        req.kv.kv_committed_len += 1
        req.output_ids.append(tok)
    return out

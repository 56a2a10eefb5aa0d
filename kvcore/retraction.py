"""A retracted request's K/V to the host and back (SGLang's ``offload_kv_cache`` / ``load_kv_cache``).

The engine moves K/V here, not the record: :class:`kvcore.record.Req` and
:class:`kvcore.record.ReqKvInfo` stay plain data, and the backup they carry across a
retraction (``kv.retraction_backup``) is a :class:`kvcore.record.RetractionBackup`.
:meth:`kvcore.Engine.retract` (``mode="offload"``) and :meth:`kvcore.Engine.resume` call
these; an engine of its own may call them the same way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvcore.capabilities import stateful
from kvcore.record import RetractionBackup

if TYPE_CHECKING:
    from kvcore.cache import BasePrefixCache
    from kvcore.pools.req_to_token import ReqToTokenPool
    from kvcore.record import Req

__all__ = ["load_kv_cache", "offload_kv_cache"]


def _backup_positions(req: Req, req_to_token_pool: ReqToTokenPool, what: str) -> torch.Tensor:
    """The slots of row positions ``[0, seqlen - 1)``: what a backup covers (ValueError, nothing changed, if
    the request holds no row or fewer positions)."""
    kv = req.kv
    if not kv.is_held:
        raise ValueError(f"{what}: request {req.rid!r} holds no req_to_token row")
    n = req.seqlen - 1
    if n > kv.kv_allocated_len:
        raise ValueError(
            f"{what}: request {req.rid!r} has {kv.kv_allocated_len} positions allocated, needs {n} (seqlen - 1)"
        )
    return req_to_token_pool.req_to_token[kv.req_pool_idx, :n].to(torch.int64)


def offload_kv_cache(req: Req, req_to_token_pool: ReqToTokenPool, cache: BasePrefixCache | None) -> RetractionBackup:
    """Copy the K/V of ``req``'s row positions ``[0, seqlen - 1)`` (and the cache's per-request state) to the host.

    The copy goes to ``req.kv.retraction_backup`` so that :func:`load_kv_cache` can put
    it back after the request was released and re-allocated.  The K/V comes from
    ``cache.kv_pool`` (None: nothing to copy, the backup keeps only the length);
    the state from ``backup_request_state(req)`` of a cache that declares
    ``Capability.REQUEST_STATE``, so a recurrent-state backend adds its state
    without the core knowing it.
    """
    slots = _backup_positions(req, req_to_token_pool, "offload_kv_cache")
    kv_pool = cache.kv_pool if cache is not None else None
    cpu = None
    if kv_pool is not None:
        # Viewed as (slots, heads, head_dim): the same read for a flat or a paged buffer layout.
        h, d = kv_pool.head_num, kv_pool.head_dim
        cpu = []
        for i in range(kv_pool.layer_num):
            k, v = kv_pool.get_kv_buffer(i)
            at = slots.to(k.device)
            cpu.append((k.view(-1, h, d)[at].to("cpu", copy=True), v.view(-1, h, d)[at].to("cpu", copy=True)))
    holder = stateful(cache) if cache is not None else None
    state = holder.backup_request_state(req) if holder is not None else None
    backup = RetractionBackup(num_tokens=int(slots.numel()), cpu_tensors=cpu, state=state)
    req.kv.retraction_backup = backup
    return backup


def load_kv_cache(req: Req, req_to_token_pool: ReqToTokenPool, cache: BasePrefixCache | None) -> RetractionBackup:
    """Write ``req.kv.retraction_backup`` back into the request's (new) row slots and drop it.

    The row must hold ``[0, seqlen - 1)`` again (ValueError, nothing changed, when it
    does not or when there is no backup).
    """
    backup = req.kv.retraction_backup
    if backup is None:
        raise ValueError(f"load_kv_cache: request {req.rid!r} has no retraction backup")
    slots = _backup_positions(req, req_to_token_pool, "load_kv_cache")
    if int(slots.numel()) != backup.num_tokens:
        raise ValueError(
            f"load_kv_cache: request {req.rid!r} backed up {backup.num_tokens} positions, "
            f"its row now covers {int(slots.numel())}"
        )
    kv_pool = cache.kv_pool if cache is not None else None
    holder = stateful(cache) if cache is not None else None
    if backup.state is not None and holder is None:
        raise ValueError(f"load_kv_cache: request {req.rid!r} backed up state; pass the cache that holds "
                         "per-request state (Capability.REQUEST_STATE)")
    if backup.cpu_tensors is not None:
        if kv_pool is None:
            raise ValueError(f"load_kv_cache: request {req.rid!r} backed up K/V but the cache has no K/V buffer")
        for i, (k, v) in enumerate(backup.cpu_tensors):
            dev = kv_pool.get_key_buffer(i).device
            kv_pool.set_kv_buffer(i, slots.to(dev), k.to(dev), v.to(dev))
    if backup.state is not None:
        assert holder is not None
        holder.restore_request_state(req, backup.state)
    req.kv.retraction_backup = None
    return backup

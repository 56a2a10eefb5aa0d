"""What a cache can do beyond the core calls, declared by the backend and reached through typed views.

:class:`~kvcore.cache.BasePrefixCache` holds the calls every cache answers
(match, insert, the two lifecycle calls, evict, locks, sizes, pools).  A few
features only some backends have: a sliding window whose slots are freed as a
request decodes, a window lock given back early, per-request state beside the
token slots (Mamba's recurrent state), sparse attention over a host tier, and
eviction reports for a write-back tier.  Each is a :class:`Capability` a
backend lists in ``cache.capabilities``, with a :class:`typing.Protocol` that
says what it adds:

=====================  ===========================  ======================================
capability             protocol                     calls
=====================  ===========================  ======================================
``WINDOWED``           :class:`WindowedCache`       ``free_window_slots(reqs, pre_lens)``
``WINDOW_LOCK_RELEASE``:class:`WindowLockRelease`   ``dec_swa_lock_only(node, lock)``
``REQUEST_STATE``      :class:`StatefulCache`       ``backup_request_state``, ``restore_request_state``,
                                                    ``request_state_slots``
``SPARSE``             :class:`SparseCache`         ``sparse_top_k()``, ``on_decode_step(reqs, selections)``
``EVICTION_REPORTS``   (none)                       the cache calls its own ``evicting(values)``
=====================  ===========================  ======================================

A caller asks with the accessor of the capability (``windowed(cache)``,
``stateful(cache)``, ...): it returns the cache typed as the protocol, or None
when the cache does not declare it.  Nothing is probed (no ``hasattr``, no
call-and-catch): a declaration is checked once, when ``create_cache`` builds
the cache (:func:`check_declared`), so a backend that declares a capability
without its calls fails there, naming them.  The declaration may depend on the
instance: the unified tree declares what its components give it (the ``swa``
component: ``WINDOWED`` and ``WINDOW_LOCK_RELEASE``; ``mamba``:
``REQUEST_STATE``).  A wrapper (:class:`~kvcore.forwarding.ForwardingCache`)
forwards the declaration and every protocol's calls, so one wrapper serves
every capability set.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, cast

if TYPE_CHECKING:
    import torch

    from kvcore.cache import BasePrefixCache, LockResult
    from kvcore.record import Req, ReqKvInfo

__all__ = [
    "Capability",
    "WindowedCache",
    "WindowLockRelease",
    "StatefulCache",
    "SparseCache",
    "windowed",
    "window_lock_release",
    "stateful",
    "sparse",
    "check_declared",
    "PROTOCOL_CALLS",
]


class Capability(enum.Enum):
    """A feature a cache declares in ``cache.capabilities`` (see the module docstring)."""

    #: Window slots are freed as requests decode (``free_window_slots``); a record's window cursor is the cache's
    #: to check.
    WINDOWED = "windowed"
    #: ``dec_swa_lock_only`` gives a window lock back early (SGLang's SGLANG_OPT_SWA_RELEASE_LEAF_LOCK_AFTER_WINDOW).
    WINDOW_LOCK_RELEASE = "window_lock_release"
    #: A request holds state beside its token slots, which a retraction backs up and a session counts.
    REQUEST_STATE = "request_state"
    #: Sparse attention: each decode step reads ``sparse_top_k()`` tokens, mapped by ``on_decode_step``.
    SPARSE = "sparse"
    #: ``evict`` calls ``evicting(values)`` with what it evicts before freeing it (a write-back tier copies it).
    EVICTION_REPORTS = "eviction_reports"


class WindowedCache(Protocol):
    """A cache with a sliding window (:attr:`Capability.WINDOWED`)."""

    def free_window_slots(self, reqs: Sequence[Req], pre_lens: Sequence[int] | None = None) -> int:
        """Free what left the attention window for a decode batch; returns the positions released.

        ``pre_lens`` defaults to each record's allocated length.
        """
        ...


class WindowLockRelease(Protocol):
    """A cache whose window lock may go back before the request ends (:attr:`Capability.WINDOW_LOCK_RELEASE`)."""

    def dec_swa_lock_only(self, node: Any, lock: LockResult | None = None) -> LockResult:
        """Give back only the window part of ``lock`` (the full lock stays), as SGLang's ``dec_swa_lock_only``.

        A scheduler calls it once a request has decoded past the window;
        ``dec_lock_ref(node, lock)`` later gives back the full side.
        """
        ...


class StatefulCache(Protocol):
    """A cache whose requests hold state beside their token slots (:attr:`Capability.REQUEST_STATE`)."""

    def backup_request_state(self, req: Req) -> Any:
        """A host copy of the state ``req`` holds beside its token slots, for
        ``kvcore.retraction.offload_kv_cache``; None when it holds none."""
        ...

    def restore_request_state(self, req: Req, state: Any) -> None:
        """Write a ``backup_request_state`` copy into the state ``req`` holds now
        (``kvcore.retraction.load_kv_cache``)."""
        ...

    def request_state_slots(self, kv: ReqKvInfo) -> int:
        """Slots of the cache's per-request state pool(s) the record ``kv`` holds (a session counts them)."""
        ...


class SparseCache(Protocol):
    """A sparse-attention cache (:attr:`Capability.SPARSE`)."""

    def sparse_top_k(self) -> int:
        """Tokens of the context one decode step reads per request."""
        ...

    def on_decode_step(self, reqs: Sequence[Req], selections: torch.Tensor) -> Any:
        """Once per decode step, after the step's slots are allocated and before its K/V is written.

        ``selections`` is an int64 ``(len(reqs), sparse_top_k())`` tensor of positions
        in ``[0, seq_len)``, -1 padded.  Returns what the attention kernel reads (the
        device locations of the selected tokens).
        """
        ...


_PROTOCOLS: dict[Capability, type | None] = {
    Capability.WINDOWED: WindowedCache,
    Capability.WINDOW_LOCK_RELEASE: WindowLockRelease,
    Capability.REQUEST_STATE: StatefulCache,
    Capability.SPARSE: SparseCache,
    Capability.EVICTION_REPORTS: None,  # the cache calls its own evicting(): nothing for a caller to reach
}

#: The calls each capability adds, read off its protocol (what :func:`check_declared` and the forwarding
#: wrapper's meta-test read).
PROTOCOL_CALLS: dict[Capability, tuple[str, ...]] = {
    cap: () if proto is None else tuple(n for n, v in vars(proto).items() if not n.startswith("_") and callable(v))
    for cap, proto in _PROTOCOLS.items()
}


def windowed(cache: BasePrefixCache) -> WindowedCache | None:
    """``cache`` as a :class:`WindowedCache` when it declares :attr:`Capability.WINDOWED`, else None."""
    return cast("WindowedCache", cache) if Capability.WINDOWED in cache.capabilities else None


def window_lock_release(cache: BasePrefixCache) -> WindowLockRelease | None:
    """``cache`` as a :class:`WindowLockRelease` when it declares it, else None."""
    return cast("WindowLockRelease", cache) if Capability.WINDOW_LOCK_RELEASE in cache.capabilities else None


def stateful(cache: BasePrefixCache) -> StatefulCache | None:
    """``cache`` as a :class:`StatefulCache` when it declares :attr:`Capability.REQUEST_STATE`, else None."""
    return cast("StatefulCache", cache) if Capability.REQUEST_STATE in cache.capabilities else None


def sparse(cache: BasePrefixCache) -> SparseCache | None:
    """``cache`` as a :class:`SparseCache` when it declares :attr:`Capability.SPARSE`, else None."""
    return cast("SparseCache", cache) if Capability.SPARSE in cache.capabilities else None


def check_declared(cache: BasePrefixCache, backend: str) -> None:
    """Refuse a built cache whose declaration is not a set of capabilities, or lacks a declared capability's calls.

    ``create_cache`` calls it once per build (a check of the declaration, like
    pluggy's ``check_pending``); nothing asks again afterwards.
    """
    caps = cache.capabilities
    if not isinstance(caps, frozenset) or not all(isinstance(c, Capability) for c in caps):
        raise TypeError(
            f"backend {backend!r}: capabilities must be a frozenset of kvcore.Capability members, got {caps!r}"
        )
    cls = type(cache)
    missing = [f"{c.name}: {name}" for c in sorted(caps, key=lambda c: c.value) for name in PROTOCOL_CALLS[c]
               if not callable(getattr(cls, name, None))]
    if missing:
        raise TypeError(
            f"backend {backend!r} ({cls.__name__}) declares capabilities without their calls "
            f"({', '.join(missing)}): define them or drop the declaration"
        )

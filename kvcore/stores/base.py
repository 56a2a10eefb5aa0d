"""The store interface and the part every store shares: framing, counters and the failure rule.

A store author implements four raw operations on framed bytes (``_exists``,
``_get``, ``_set``, ``_clear``) and may raise anything from them: a connection
refused, a timeout, a full server.  :class:`KVStore` turns each raised exception
into a miss or a ``False`` and counts it in ``stats()["errors"]`` (one per failed
round trip), checks every value's frame (a bad one is a miss, counted as an
error too), and counts hits, misses, bytes and round trips.  Bad *arguments*
(keys that are not strings, a values list of another length) are the caller's
bug and raise ``ValueError`` before anything is sent.

Three ways to read, one set of rules: ``batch_get`` answers ``bytes`` (a copy the
caller owns), ``batch_get_views`` read-only memoryviews of the payload inside
the frame the store read (no copy out of it), ``batch_get_into`` writes each
payload into a buffer the caller gives (a host-tier page, a pinned block) and
answers whether it holds a checked value.  A store that can read faster than
through ``_get`` overrides ``_get_buffers`` (framed values in buffers of its
own) and ``_get_into`` (payloads straight into the caller's buffers); the
defaults go through ``_get``, so every store has all three.
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, cast

from kvcore.stores.framing import FRAME_OVERHEAD, check_split, frame, unframe_view

if TYPE_CHECKING:
    import numpy as np
    from typing_extensions import Buffer

__all__ = ["KVStore", "StoreStats"]

log = logging.getLogger("kvcore.stores")


@dataclass(slots=True)
class StoreStats:
    """What a store has done since it was opened (or since ``reset_stats()``)."""

    hits: int = 0
    misses: int = 0
    errors: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    round_trips: int = 0


def _check_keys(keys: Sequence[str]) -> list[str]:
    keys = list(keys)
    for k in keys:
        if not isinstance(k, str) or not k:
            raise ValueError(f"store keys must be non-empty strings, got {k!r}")
    return keys


def _check_buffers(buffers: Sequence[Buffer | np.ndarray[Any, Any]], n: int) -> list[memoryview]:
    """Each buffer as a writable flat byte view; ``ValueError`` naming the first that is not one."""
    buffers = list(buffers)
    if len(buffers) != n:
        raise ValueError(f"batch_get_into got {n} keys but {len(buffers)} buffers")
    out = []
    for i, b in enumerate(buffers):
        try:
            # numpy's stubs for Python < 3.12 do not declare its arrays buffers; they are.
            view = memoryview(cast("Buffer", b))
        except TypeError:
            raise ValueError(f"buffers[{i}] is a {type(b).__name__}, not a buffer: pass a bytearray, a memoryview "
                             "or a numpy array (a torch CPU tensor: t.numpy())") from None
        if view.readonly:
            raise ValueError(f"buffers[{i}] is read-only: batch_get_into writes into it (pass a bytearray, "
                             "not bytes)")
        if not view.c_contiguous:
            raise ValueError(f"buffers[{i}] is not contiguous: pass a contiguous buffer (t.contiguous())")
        out.append(view if view.format == "B" and view.ndim == 1 else view.cast("B"))
    return out


class KVStore(ABC):
    """A key-value store of page K/V bytes that never raises for its own failures (see the module doc).

    ``url`` is what it was opened with (``kvcore.open_store``); ``ttl`` the
    seconds a written value lives (None: until evicted or cleared) for stores that
    keep one.  Methods are safe to call from several threads.
    """

    #: Whether ``ttl`` is honoured (memory, file and Redis do).
    supports_ttl: bool = True

    def __init__(self, url: str, ttl: float | None = None) -> None:
        self.url = url
        self.ttl = ttl
        self._stats = StoreStats()
        self._stats_lock = threading.Lock()
        self._closed = False
        self._warned = False

    # -- what a store implements ---------------------------------------------

    @abstractmethod
    def _exists(self, keys: list[str]) -> list[bool]:
        """Whether each key is present (one round trip where the store allows)."""

    @abstractmethod
    def _get(self, keys: list[str]) -> list[bytes | None]:
        """The framed bytes under each key, None where absent."""

    @abstractmethod
    def _set(self, keys: list[str], values: list[bytes]) -> list[bool]:
        """Store framed bytes under each key; whether each write was accepted."""

    @abstractmethod
    def _clear(self) -> None:
        """Drop every value this store's URL addresses."""

    def _get_buffers(self, keys: list[str]) -> Sequence[bytes | bytearray | memoryview | None]:
        """The framed value under each key in any buffer, None where absent (default: ``_get``).

        A store that reads into buffers of its own (a socket's ``recv_into``) answers those; the
        base class checks them in place and never writes to them.  ``batch_get_views`` hands views
        of them to the caller, so nothing may write to or reuse them afterwards."""
        return self._get(keys)

    def _get_into(self, keys: list[str], targets: list[memoryview]) -> list[tuple[bytes, int] | None]:
        """Read each key's payload into its target; per key None where absent, else ``(header, size)``:
        the value's first ``FRAME_OVERHEAD`` bytes (all of it if shorter) and its size in bytes.

        The payload (what follows the header) goes into the target when, and only when,
        ``size == FRAME_OVERHEAD + target.nbytes``; the base class checks the rest.  The default
        reads through ``_get_buffers`` and copies."""
        out: list[tuple[bytes, int] | None] = []
        for data, target in zip(self._get_buffers(keys), targets, strict=True):
            if data is None:
                out.append(None)
                continue
            view = memoryview(data).cast("B") if isinstance(data, memoryview) else memoryview(data)
            if view.nbytes == FRAME_OVERHEAD + target.nbytes:
                target[:] = view[FRAME_OVERHEAD:]
            out.append((bytes(view[:FRAME_OVERHEAD]), view.nbytes))
        return out

    def _close(self) -> None:
        """Release connections and files (default: nothing to release)."""

    def _round_trips(self, keys: list[str]) -> int:
        """Round trips one batched call over ``keys`` costs (1; a cluster: one per node it touches)."""
        return 1

    # -- the interface --------------------------------------------------------

    def batch_exists(self, keys: Sequence[str]) -> int:
        """How many of ``keys``, counted from the start, are present: prefixes are contiguous,
        so the first absent key ends the count.  A failure answers 0."""
        keys = _check_keys(keys)
        if not keys or self._closed:
            return 0
        present = self._guard("exists", keys, lambda: self._exists(keys))
        if present is None:
            return 0
        n = 0
        for p in present:
            if not p:
                break
            n += 1
        return n

    def batch_get(self, keys: Sequence[str]) -> list[bytes | None]:
        """The payload under each key, None for a miss: absent, failed, or a value whose length or
        checksum does not hold (truncated, foreign, corrupted)."""
        return [None if v is None else bytes(v) for v in self._views(_check_keys(keys))]

    def batch_get_views(self, keys: Sequence[str]) -> list[memoryview | None]:
        """As ``batch_get``, but each payload as a read-only memoryview of the frame the store read,
        not copied out of it.  A view is the caller's to keep: the store never writes to or reuses
        what it points into (``memoryview.release()`` is not needed).  Same misses, same counters."""
        return self._views(_check_keys(keys))

    def batch_get_unchecked(self, keys: Sequence[str]) -> list[memoryview | None]:
        """Each value's payload (what follows its frame header) with the frame's length and checksum
        *not* checked; None where absent or on a failure (never raises).  Only for tests that prove
        a check matters (garbage read this way reaches the caller); a serving path reads
        ``batch_get_views`` / ``batch_get_into``.  Counts round trips and failures, not hits or misses."""
        keys = _check_keys(keys)
        raw = None if self._closed or not keys else self._guard("get", keys, lambda: self._get_buffers(keys))
        if raw is None:
            return [None] * len(keys)
        return [None if d is None else memoryview(d).cast("B")[FRAME_OVERHEAD:] for d in raw]

    def batch_get_into(self, keys: Sequence[str], buffers: Sequence[Buffer | np.ndarray[Any, Any]]) -> list[bool]:
        """Write the payload under each key into its buffer; whether each buffer now holds it.

        A buffer is anything writable and contiguous with the buffer protocol (a bytearray, a
        memoryview, a numpy array; a torch CPU tensor through ``t.numpy()``), sized to the payload
        it expects: a value of another size is a miss, like one that fails its checksum (both
        counted in ``errors``).  Where the answer is False the buffer's contents are unspecified
        (a value that failed its check may have been written there): do not use them.  A failure
        answers False for its keys and never raises; bad arguments raise ``ValueError``."""
        keys = _check_keys(keys)
        targets = _check_buffers(buffers, len(keys))
        if not keys:
            return []
        got = None if self._closed else self._guard("get", keys, lambda: self._get_into(keys, targets))
        if got is None:
            self._count(misses=len(keys))
            return [False] * len(keys)
        out: list[bool] = []
        hits = misses = bad = nbytes = 0
        for key, target, g in zip(keys, targets, got, strict=True):
            ok = g is not None and check_split(key, g[0], g[1], target)
            if ok:
                hits += 1
                nbytes += target.nbytes
            else:
                misses += 1
                bad += g is not None
            out.append(ok)
        self._count(hits=hits, misses=misses, errors=bad, bytes_read=nbytes)
        return out

    def _views(self, keys: list[str]) -> list[memoryview | None]:
        if not keys:
            return []
        raw = None if self._closed else self._guard("get", keys, lambda: self._get_buffers(keys))
        if raw is None:
            self._count(misses=len(keys))
            return [None] * len(keys)
        out: list[memoryview | None] = []
        hits = misses = bad = nbytes = 0
        for key, data in zip(keys, raw, strict=True):
            payload = unframe_view(key, data)
            if payload is None:
                misses += 1
                bad += data is not None
            else:
                hits += 1
                nbytes += payload.nbytes
            out.append(payload)
        self._count(hits=hits, misses=misses, errors=bad, bytes_read=nbytes)
        return out

    def batch_set(self, keys: Sequence[str], values: Sequence[bytes | bytearray | memoryview]) -> list[bool]:
        """Write each payload under its key; False where the store refused or failed."""
        keys = _check_keys(keys)
        values = list(values)
        if len(values) != len(keys):
            raise ValueError(f"batch_set got {len(keys)} keys but {len(values)} values")
        for v in values:
            if not isinstance(v, bytes | bytearray | memoryview):
                raise ValueError(f"store values must be bytes, got {type(v).__name__}")
        if not keys or self._closed:
            return [False] * len(keys)
        framed = [frame(k, v) for k, v in zip(keys, values, strict=True)]
        ok = self._guard("set", keys, lambda: self._set(keys, framed))
        if ok is None:
            return [False] * len(keys)
        self._count(bytes_written=sum(len(v) for v, good in zip(values, ok, strict=True) if good))
        return list(ok)

    def clear(self) -> bool:
        """Drop every value; False when the store could not be reached."""
        if self._closed:
            return False
        return self._guard("clear", [], self._clear, trips=1) is not None

    def stats(self) -> dict[str, int]:
        """``hits``, ``misses``, ``errors``, ``bytes_read``, ``bytes_written``, ``round_trips``."""
        with self._stats_lock:
            return asdict(self._stats)

    def reset_stats(self) -> None:
        with self._stats_lock:
            self._stats = StoreStats()

    def close(self) -> None:
        """Release connections; later calls answer misses and ``False``."""
        if not self._closed:
            self._closed = True
            try:
                self._close()
            except Exception as exc:  # closing a store that is already gone is not the caller's failure
                log.debug("closing %s failed: %s", self.url, exc)

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    # -- the failure rule -----------------------------------------------------

    def _guard(self, what: str, keys: list[str], call: Callable[[], Any], trips: int | None = None) -> Any:
        """Run one raw operation; on any exception count an error and answer None (the caller's miss)."""
        try:
            self._count(round_trips=self._round_trips(keys) if trips is None else trips)
            result = call()
        except Exception as exc:  # the failure rule: a store failure is a miss, never the engine's exception
            self._failed(what, exc)
            return None
        return True if result is None else result

    def _failed(self, what: str, exc: BaseException) -> None:
        """Count one failed round trip (a cluster store calls it for the one node that failed)."""
        self._count(errors=1)
        if not self._warned:
            # One line per store: a dead server must not flood the log at every step.
            self._warned = True
            log.warning("store %s: %s failed (%s: %s); answering misses", self.url, what, type(exc).__name__, exc)

    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            s = self._stats
            for name, d in deltas.items():
                setattr(s, name, getattr(s, name) + d)

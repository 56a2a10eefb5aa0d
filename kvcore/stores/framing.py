"""How a value sits in a store: a header with its length and a checksum, then the payload.

The checksum covers the key too, so a value copied under another key (a foreign
value: another namespace's page, another store's bytes) fails like a corrupted
one.  CRC-32 is enough: it guards against truncation and garbage, not against an
attacker with write access to the store.

Three ways to check a frame, by who owns the bytes: :func:`unframe` copies the
payload out (``bytes``), :func:`unframe_view` answers a view of it inside the
frame (no copy), and :func:`check_split` checks a frame whose header and
payload were read apart (the payload straight into a caller's buffer).
"""

from __future__ import annotations

import struct
import zlib

__all__ = ["FRAME_OVERHEAD", "check_split", "frame", "unframe", "unframe_view"]

_MAGIC = b"KVC1"
_HEADER = struct.Struct("<4sQI")
#: Bytes a frame adds to a payload.
FRAME_OVERHEAD = _HEADER.size

_Bytes = bytes | bytearray | memoryview


def _checksum(key: str, payload: _Bytes) -> int:
    return zlib.crc32(payload, zlib.crc32(key.encode("utf-8")))


def _nbytes(data: _Bytes) -> int:
    return data.nbytes if isinstance(data, memoryview) else len(data)


def frame(key: str, payload: _Bytes) -> bytes:
    """``payload`` with the header that ``unframe`` checks."""
    return _HEADER.pack(_MAGIC, _nbytes(payload), _checksum(key, payload)) + bytes(payload)


def unframe_view(key: str, data: _Bytes | None) -> memoryview | None:
    """A read-only view of the payload inside ``data`` (no copy); None when it is absent, truncated,
    foreign or corrupted.  The view keeps ``data`` alive; whoever may still write ``data`` must not
    hand the view on."""
    if data is None:
        return None
    view = memoryview(data)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    if view.nbytes < FRAME_OVERHEAD:
        return None
    magic, length, crc = _HEADER.unpack_from(view)
    if magic != _MAGIC or length != view.nbytes - FRAME_OVERHEAD:
        return None
    payload = view[FRAME_OVERHEAD:].toreadonly()
    if _checksum(key, payload) != crc:
        return None
    return payload


def unframe(key: str, data: _Bytes | None) -> bytes | None:
    """The payload of a frame written under ``key``; None when it is absent, truncated, foreign or corrupted."""
    payload = unframe_view(key, data)
    return None if payload is None else bytes(payload)


def check_split(key: str, header: _Bytes, total: int, payload: memoryview) -> bool:
    """Whether a frame of ``total`` bytes that began with ``header`` and whose payload now fills
    ``payload`` is one written under ``key``.  ``total`` is the value's real size: a store reads the
    payload into ``payload`` only when ``total == FRAME_OVERHEAD + payload.nbytes``, and any other
    size fails here, so a stale buffer never passes for a short value."""
    if total != FRAME_OVERHEAD + payload.nbytes or _nbytes(header) != FRAME_OVERHEAD:
        return False
    magic, length, crc = _HEADER.unpack_from(header)
    return magic == _MAGIC and length == payload.nbytes and _checksum(key, payload) == crc

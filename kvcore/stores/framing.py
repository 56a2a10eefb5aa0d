"""How a value sits in a store: a header with its length and a checksum, then the payload.

The checksum covers the key too, so a value copied under another key (a foreign
value: another namespace's page, another store's bytes) fails like a corrupted
one.  CRC-32 is enough: it guards against truncation and garbage, not against an
attacker with write access to the store.
"""

from __future__ import annotations

import struct
import zlib

__all__ = ["FRAME_OVERHEAD", "frame", "unframe"]

_MAGIC = b"KVC1"
_HEADER = struct.Struct("<4sQI")
#: Bytes a frame adds to a payload.
FRAME_OVERHEAD = _HEADER.size


def _checksum(key: str, payload: bytes | bytearray | memoryview) -> int:
    return zlib.crc32(payload, zlib.crc32(key.encode("utf-8")))


def frame(key: str, payload: bytes | bytearray | memoryview) -> bytes:
    """``payload`` with the header that ``unframe`` checks."""
    return _HEADER.pack(_MAGIC, len(payload), _checksum(key, payload)) + bytes(payload)


def unframe(key: str, data: bytes | None) -> bytes | None:
    """The payload of a frame written under ``key``; None when it is absent, truncated, foreign or corrupted."""
    if data is None or len(data) < FRAME_OVERHEAD:
        return None
    magic, length, crc = _HEADER.unpack_from(data)
    if magic != _MAGIC or length != len(data) - FRAME_OVERHEAD:
        return None
    payload = memoryview(data)[FRAME_OVERHEAD:]
    if _checksum(key, payload) != crc:
        return None
    return bytes(payload)

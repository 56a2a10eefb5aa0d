"""The zero-copy RESP packer writes the bytes redis-py's own packer writes, and keeps a large value uncopied."""

from __future__ import annotations

import pytest
from kvcore_redis.packer import ZeroCopyPacker
from redis.connection import PythonRespSerializer
from redis.utils import HIREDIS_AVAILABLE


def reference(*args: object) -> bytes:
    from redis._parsers.encoders import Encoder

    return b"".join(PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode).pack(*args))


@pytest.mark.parametrize("args", [
    ("SET", "kvcore:k", b"v" * 10, "PX", 600000),
    ("SET", "kvcore:big", b"\x00\xff" * 50_000),
    ("MGET", "a", "b", "kvcore:c"),
    ("CLUSTER SLOTS",),
    ("SCAN", 0, "MATCH", "kvcore*", "COUNT", 1000),
    ("SET", "k", bytearray(b"x" * 7000)),
    ("SET", "k", 1.5),
])
def test_same_bytes_as_redis_py(args):
    assert b"".join(bytes(c) for c in ZeroCopyPacker().pack(*args)) == reference(*args)


def test_a_large_value_is_sent_as_the_callers_object():
    value = b"p" * 262_144
    chunks = ZeroCopyPacker().pack("SET", "kvcore:page", value)
    assert any(c is value for c in chunks)


def test_hiredis_is_what_it_replaces():
    assert HIREDIS_AVAILABLE  # kvcore-redis depends on redis[hiredis]: the copy it avoids is hiredis.pack_command's


def test_arguments_redis_cannot_take_are_refused():
    with pytest.raises(TypeError, match="bool"):
        ZeroCopyPacker().pack("SET", "k", True)
    with pytest.raises(TypeError, match="cannot send"):
        ZeroCopyPacker().pack("SET", "k", object())

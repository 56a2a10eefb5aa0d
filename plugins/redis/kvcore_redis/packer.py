"""A RESP command packer that sends a large value as its own buffer instead of copying it into one.

redis-py with hiredis packs a whole command, page values included, into one new
``bytes`` (``hiredis.pack_command``): for a pipeline of 256 KiB pages that copy
costs about as much as the socket send.  This packer (redis-py's
``command_packer`` connection option) keeps each argument over
``_CUTOFF`` bytes as the caller's object, so ``sendall`` sends the frame kvcore
built and the command's small parts are joined around it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ZeroCopyPacker"]

# redis-py's own cutoff for sending a value as a separate chunk (Connection._buffer_cutoff).
_CUTOFF = 6000


def _encode(arg: Any) -> bytes | memoryview:
    # The argument types kvcore's commands carry, encoded as redis-py's Encoder does.
    if isinstance(arg, bytes | memoryview):
        return arg
    if isinstance(arg, bytearray):
        return memoryview(arg)
    if isinstance(arg, str):
        return arg.encode("utf-8")
    if isinstance(arg, bool):
        raise TypeError(f"a bool is not a Redis argument: {arg!r}")
    if isinstance(arg, int):
        return str(arg).encode()
    if isinstance(arg, float):
        return repr(arg).encode()
    raise TypeError(f"cannot send {type(arg).__name__} to Redis: {arg!r}")


class ZeroCopyPacker:
    """``pack(*args)``: the command as a list of buffers, each argument over the cutoff a buffer of its own."""

    def pack(self, *args: Any) -> list[bytes | memoryview]:
        first = args[0]
        if isinstance(first, str) and " " in first:  # "CLUSTER SLOTS": the server wants the words apart
            args = tuple(first.split()) + args[1:]
        out: list[bytes | memoryview] = []
        head: list[bytes] = [b"*%d\r\n" % len(args)]
        for arg in map(_encode, args):
            size = arg.nbytes if isinstance(arg, memoryview) else len(arg)
            head.append(b"$%d\r\n" % size)
            if size > _CUTOFF:
                out.append(b"".join(head))
                out.append(arg)
                head = [b"\r\n"]
            else:
                head.append(bytes(arg))
                head.append(b"\r\n")
        out.append(b"".join(head))
        return out

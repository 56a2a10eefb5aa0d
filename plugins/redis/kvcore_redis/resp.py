"""The read path's own RESP client: GET and MGET replies parsed off a plain socket, values read with ``recv_into``.

redis-py hands every reply to its parser (hiredis), which copies a value into its
read buffer and again into a new ``bytes``; for pages of hundreds of KiB those
copies, not the network, bound a read.  Here the header line of each value is
read through a small buffer and the value itself straight from the socket into
its destination: a fresh ``bytearray`` (``batch_get``, ``batch_get_views``) or,
past the frame header, the caller's own buffer (``batch_get_into``).

Only replies to GET and MGET are parsed; everything else (writes, EXISTS, SCAN,
CLUSTER SLOTS) stays with redis-py.  A connection whose exchange failed in any
way (timeout, reset, an error reply, a malformed reply) is closed, never reused:
what it would read next is unknown.
"""

from __future__ import annotations

import select
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import redis
from redis.exceptions import InvalidResponse

__all__ = ["RawConnection", "RawPool"]

# The line buffer: header lines are short; a value's bytes pass through it only when they arrived with a header.
_LINE_BUFFER = 1 << 16


def _command(*args: bytes) -> bytes:
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)


class RawConnection:
    """One socket to one server, authenticated and on its database, that reads GET/MGET replies."""

    def __init__(self, sock: socket.socket, frame_header: int = 0) -> None:
        """Over a connected socket (``connect`` opens one); ``frame_header``: bytes of a value
        ``get_into`` answers apart, the rest going into the caller's buffer."""
        self.sock = sock
        self._buf = bytearray(_LINE_BUFFER)
        self._view = memoryview(self._buf)
        self._pos = self._end = 0
        self._header = frame_header
        self._poll = select.poll()
        self._poll.register(sock, select.POLLIN)

    @classmethod
    def connect(cls, host: str, port: int, timeout: float, db: int = 0, username: str | None = None,
                password: str | None = None, frame_header: int = 0) -> RawConnection:
        """A connection to ``host:port`` whose every wait ends after ``timeout`` seconds, authenticated
        and on database ``db``."""
        sock = socket.create_connection((host, port), timeout=timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = cls(sock, frame_header)
            if password is not None:
                auth = [b"AUTH"] + ([username.encode()] if username else []) + [password.encode()]
                conn._simple(_command(*auth))
            if db:
                conn._simple(_command(b"SELECT", str(db).encode()))
        except BaseException:
            sock.close()
            raise
        return conn

    def idle_and_open(self) -> bool:
        """Whether the connection can take a request: nothing is waiting to be read on it.  A server
        that closed it (restarted, killed) left an end of file there; any other byte is out of step."""
        return not self._poll.poll(0)

    def close(self) -> None:
        self.sock.close()

    # -- what the store calls -------------------------------------------------

    def get_values(self, keys: list[str], mget: bool) -> list[memoryview | None]:
        """The value of each key (``MGET`` if ``mget``, else pipelined ``GET``), each a view of memory
        of its own: one block per call, sized by the first value for all that follow (KV pages are of
        one size), a value that does not fit a block of its own.  Nothing here is reused later."""
        out: list[memoryview | None] = []
        block, used = memoryview(b""), 0
        for i in self._replies(keys, mget):
            n = self._bulk_len()
            if n < 0:
                out.append(None)
                continue
            if used + n > block.nbytes:
                # Fresh memory for each large value is costly (the allocator returns freed pages to the
                # system, so each new one faults again): one block per call is read into instead.
                block, used = memoryview(bytearray(n if block.nbytes else n * (len(keys) - i))), 0
            value = block[used:used + n]
            used += n
            self._read_exact(value)
            self._crlf()
            out.append(value)
        return out

    def get_into(self, keys: list[str], targets: list[memoryview], mget: bool) -> list[tuple[bytes, int] | None]:
        """Each key's value split at the frame header: the header is answered, the rest read into the
        key's target when it fills the target exactly, else read past.  Per key None (absent) or
        ``(header, size of the whole value)``, as ``KVStore._get_into`` answers."""
        out: list[tuple[bytes, int] | None] = []
        for i in self._replies(keys, mget):
            n = self._bulk_len()
            if n < 0:
                out.append(None)
                continue
            target = targets[i]
            header = bytearray(min(n, self._header))
            self._read_exact(memoryview(header))
            rest = n - len(header)
            if len(header) == self._header and rest == target.nbytes:
                self._read_exact(target)
            else:
                self._skip(rest)
            self._crlf()
            out.append((bytes(header), n))
        return out

    # -- the protocol ---------------------------------------------------------

    def _replies(self, keys: list[str], mget: bool) -> range:
        """Send the request; the positions of the bulk replies to read, in order."""
        enc = [k.encode("utf-8") for k in keys]
        if mget:
            self.sock.sendall(_command(b"MGET", *enc))
            n = self._array_len()
            if n != len(keys):
                raise InvalidResponse(f"MGET of {len(keys)} keys answered {n} values")
        else:
            self.sock.sendall(b"".join(_command(b"GET", k) for k in enc))
        return range(len(keys))

    def _simple(self, request: bytes) -> None:
        self.sock.sendall(request)
        line = self._line()
        if line[:1] == b"-":
            raise redis.ResponseError(line[1:].decode("utf-8", "replace"))
        if line[:1] != b"+":
            raise InvalidResponse(f"expected a status reply, got {line[:40]!r}")

    def _array_len(self) -> int:
        line = self._line()
        if line[:1] == b"*":
            return int(line[1:])
        if line[:1] == b"-":
            raise redis.ResponseError(line[1:].decode("utf-8", "replace"))
        raise InvalidResponse(f"expected an array reply, got {line[:40]!r}")

    def _bulk_len(self) -> int:
        line = self._line()
        if line[:1] == b"$":
            return int(line[1:])
        if line[:1] == b"-":
            # MOVED, WRONGTYPE, NOAUTH...: redis-py's exception, so the stores' handlers see what they expect.
            raise redis.ResponseError(line[1:].decode("utf-8", "replace"))
        raise InvalidResponse(f"expected a bulk string reply, got {line[:40]!r}")

    # -- bytes off the socket -------------------------------------------------

    def _fill(self) -> None:
        """At least one more byte into the line buffer."""
        if self._pos == self._end:
            self._pos = self._end = 0
        elif self._end == len(self._buf):
            kept = self._end - self._pos
            if kept == len(self._buf):
                raise InvalidResponse(f"a reply line longer than {len(self._buf)} bytes")
            self._buf[:kept] = bytes(self._view[self._pos:self._end])
            self._pos, self._end = 0, kept
        got = self.sock.recv_into(self._view[self._end:])
        if not got:
            raise redis.ConnectionError("the server closed the connection")
        self._end += got

    def _line(self) -> bytes:
        scanned = 0
        while True:
            i = self._buf.find(b"\r\n", self._pos + scanned, self._end)
            if i >= 0:
                line = bytes(self._view[self._pos:i])
                self._pos = i + 2
                return line
            scanned = max(0, self._end - self._pos - 1)  # a "\r" at the end may pair with the next byte
            self._fill()

    def _read_exact(self, target: memoryview) -> None:
        n = target.nbytes
        have = min(n, self._end - self._pos)
        if have:
            target[:have] = self._view[self._pos:self._pos + have]
            self._pos += have
        while have < n:
            got = self.sock.recv_into(target[have:])
            if not got:
                raise redis.ConnectionError("the server closed the connection")
            have += got

    def _skip(self, n: int) -> None:
        have = min(n, self._end - self._pos)
        self._pos += have
        n -= have
        while n:
            self._pos = self._end = 0
            got = self.sock.recv_into(self._view[:min(n, len(self._buf))])
            if not got:
                raise redis.ConnectionError("the server closed the connection")
            n -= got

    def _crlf(self) -> None:
        while self._end - self._pos < 2:
            self._fill()
        if self._view[self._pos:self._pos + 2] != b"\r\n":
            raise InvalidResponse("a bulk string reply did not end with CRLF")
        self._pos += 2


class RawPool:
    """Idle connections to one server, handed out one per call (threads each get their own)."""

    def __init__(self, connect: Callable[[], RawConnection]) -> None:
        self._connect = connect
        self._idle: list[RawConnection] = []
        self._lock = threading.Lock()
        self._closed = False

    @contextmanager
    def connection(self) -> Iterator[RawConnection]:
        conn = None
        with self._lock:
            while self._idle:
                c = self._idle.pop()
                if c.idle_and_open():
                    conn = c
                    break
                c.close()
        if conn is None:
            conn = self._connect()
        try:
            yield conn
        except BaseException:
            conn.close()
            raise
        with self._lock:
            if self._closed:
                conn.close()
            else:
                self._idle.append(conn)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for c in idle:
            c.close()

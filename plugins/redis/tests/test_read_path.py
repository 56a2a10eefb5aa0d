"""The read path's own RESP client (kvcore_redis.resp) against real servers: every size, every reply, every fault.

Values are chosen to straddle the client's 64 KiB line buffer and to hold the bytes
RESP uses as delimiters; each read API must give back exactly what was written.
"""

from __future__ import annotations

import os
import random
import socket
import threading

import pytest
import redis
from kvcore_redis import RedisStore
from kvcore_redis.resp import RawConnection
from kvcore_redis.servers import RedisServer
from redis.exceptions import InvalidResponse

import kvcore
from kvcore.stores import FRAME_OVERHEAD

SIZES = [0, 1, 2, 3, 100, 65_534 - FRAME_OVERHEAD, 65_535 - FRAME_OVERHEAD, 65_536 - FRAME_OVERHEAD,
         65_537, 131_072, 300_001]


def payloads() -> list[bytes]:
    # RESP's own delimiters inside the values, at the start, the end and across a buffer boundary.
    out = []
    for n in SIZES:
        body = bytearray(os.urandom(n))
        for at in (0, n // 2, n - 5, 65_530 - FRAME_OVERHEAD):
            if 0 <= at <= n - 5:
                body[at:at + 5] = b"\r\n$-1"
        out.append(bytes(body))
    return out


@pytest.fixture
def store(redis_server) -> RedisStore:
    s = kvcore.open_store(f"redis://{redis_server.address}/0?timeout=2&backoff=0")
    assert isinstance(s, RedisStore)
    yield s
    s.close()


def keys_of(name: str, n: int) -> list[str]:
    return [f"kvcore-read:{os.getpid()}:{name}:{i}" for i in range(n)]


@pytest.mark.parametrize("cluster", [False, True], ids=["server", "cluster"])
def test_every_size_through_every_read_api(request, cluster: bool) -> None:
    url = (request.getfixturevalue("redis_cluster").url if cluster
           else f"redis://{request.getfixturevalue('redis_server').address}/0") + "?timeout=2"
    s = kvcore.open_store(url)
    values = payloads()
    n = len(values)
    keys = keys_of(f"sizes-{cluster}", n + 2)
    # Absent keys between present ones: a nil reply must not shift the values after it.
    order = [keys[0], keys[n], *keys[1:n - 1], keys[n + 1], keys[n - 1]]
    want = [values[0], None, *values[1:-1], None, values[-1]]
    assert all(s.batch_set([k for k, v in zip(order, want, strict=True) if v is not None],
                           [v for v in want if v is not None]))
    for _ in range(2):  # the second time on a connection the first left in the pool
        assert s.batch_get(order) == want
        assert [None if v is None else bytes(v) for v in s.batch_get_views(order)] == want
        buffers = [bytearray(len(v) if v is not None else 7) for v in want]
        assert s.batch_get_into(order, buffers) == [v is not None for v in want]
        present = [v for v in want if v is not None]
        assert [bytes(b) for b, v in zip(buffers, want, strict=True) if v is not None] == present
    st = s.stats()
    assert st["errors"] == 0 and st["hits"] == 6 * len(values) and st["misses"] == 6 * 2
    s.clear()
    s.close()


def test_a_long_batch_of_small_values(store: RedisStore) -> None:
    keys = keys_of("many", 2000)
    values = [os.urandom(i % 37) for i in range(2000)]
    assert all(store.batch_set(keys, values))
    assert store.batch_get(keys) == values
    buffers = [bytearray(len(v)) for v in values]
    assert all(store.batch_get_into(keys, buffers)) and buffers == values


def test_a_key_of_another_type_is_a_miss(store: RedisStore) -> None:
    (key,) = keys_of("list", 1)
    store.client.rpush(key, b"x")
    before = store.stats()
    assert store.batch_get_views([key]) == [None]  # MGET answers nil for a key that holds no string
    assert store.batch_get_into([key], [bytearray(1)]) == [False]
    assert store.stats()["misses"] - before["misses"] == 2


def test_a_cluster_node_answering_an_error_misses_its_keys(redis_cluster) -> None:
    s = kvcore.open_store(redis_cluster.url + "?timeout=2&backoff=0")
    (key,) = keys_of("cluster-list", 1)
    s.client_for(key).rpush(key, b"x")  # GET of a list: -WRONGTYPE
    errors = s.stats()["errors"]
    assert s.batch_get_into([key], [bytearray(1)]) == [False]
    assert s.stats()["errors"] == errors + 1
    s.client_for(key).delete(key)
    assert s.batch_set([key], [b"v"]) == [True] and s.batch_get_views([key])[0] == b"v"
    s.close()


def test_concurrent_readers_each_get_their_own_values(store: RedisStore) -> None:
    keys = keys_of("threads", 64)
    values = [os.urandom(20_000 + 997 * i) for i in range(64)]
    assert all(store.batch_set(keys, values))
    failures: list[BaseException] = []

    def reader(t: int) -> None:
        try:
            mine = list(range(t, 64, 8))
            for _ in range(10):
                buffers = [bytearray(len(values[i])) for i in mine]
                assert store.batch_get_into([keys[i] for i in mine], buffers) == [True] * len(mine)
                assert buffers == [values[i] for i in mine]
                assert [bytes(v or b"") for v in store.batch_get_views([keys[i] for i in mine])] == \
                    [values[i] for i in mine]
        except BaseException as exc:  # surfaced below: a thread's exception would otherwise vanish
            failures.append(exc)

    threads = [threading.Thread(target=reader, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures
    assert store.stats()["errors"] == 0


def test_a_reply_cut_by_the_timeout_is_never_read_as_the_next_one(own_server: RedisServer) -> None:
    own_server.start()
    s = kvcore.open_store(f"redis://{own_server.address}/0?timeout=0.3&backoff=0")
    a, b = keys_of("cut", 2)
    va, vb = os.urandom(500_000), os.urandom(500_000)
    assert s.batch_set([a, b], [va, vb]) == [True, True]
    own_server.pause()  # SIGSTOP: the request is queued, its reply comes only after the resume
    try:
        assert s.batch_get_into([a], [bytearray(len(va))]) == [False]
        assert s.batch_get_views([a]) == [None]
    finally:
        own_server.resume()
    # The stalled connections' late replies (va) must not be taken for b's.
    got = bytearray(len(vb))
    assert s.batch_get_into([b], [got]) == [True] and got == vb
    assert s.batch_get_views([b, a]) == [vb, va]
    assert s.stats()["errors"] >= 2
    s.close()


def test_password_and_database(tmp_path) -> None:
    with RedisServer(tmp_path / "auth", password="s3cret") as server:
        (key,) = keys_of("auth", 1)
        good = kvcore.open_store(f"redis://:s3cret@{server.address}/3?timeout=1")
        assert good.batch_set([key], [b"in db 3"]) == [True]
        buf = bytearray(7)
        assert good.batch_get_into([key], [buf]) == [True] and buf == b"in db 3"
        assert good.batch_get_views([key]) == [b"in db 3"]
        with server.client() as c:
            assert c.get(key) is None  # db 0
            c.select(3)
            assert c.get(key) is not None
        bad = kvcore.open_store(f"redis://:wrong@{server.address}/3?timeout=1&backoff=0")
        assert bad.batch_get_into([key], [bytearray(7)]) == [False]
        assert bad.batch_get_views([key]) == [None]
        assert bad.stats()["errors"] == 2
        good.close()
        bad.close()


# -- the parser on replies cut where a test wants ------------------------------------------------
# Real servers cannot be made to cut a reply at a chosen byte: these feed RawConnection a socket
# pair whose reading end hands out a few bytes per read, at sizes drawn from a seed.


class Choppy:
    """A socket whose every ``recv_into`` returns at most a drawn number of bytes."""

    def __init__(self, sock: socket.socket, seed: int) -> None:
        self.sock = sock
        self.rng = random.Random(seed)

    def recv_into(self, buf: memoryview) -> int:
        n = self.rng.choice([1, 2, 3, 7, 13, 4096, 70_000])
        return self.sock.recv_into(buf[:n])

    def sendall(self, data: bytes) -> None:
        self.sock.sendall(data)

    def fileno(self) -> int:
        return self.sock.fileno()

    def close(self) -> None:
        self.sock.close()


class Peer(threading.Thread):
    """The writing end (kept alive by the test, so the reader's request never meets a closed socket)."""

    def __init__(self, sock: socket.socket, data: bytes, close: bool) -> None:
        super().__init__(daemon=True)
        self.sock, self.data, self.close = sock, data, close

    def run(self) -> None:
        self.sock.sendall(self.data)
        if self.close:
            self.sock.shutdown(socket.SHUT_WR)


def serve(reply: bytes, seed: int, close_after: int | None = None) -> tuple[RawConnection, Peer]:
    ours, theirs = socket.socketpair()
    ours.settimeout(10)
    peer = Peer(theirs, reply if close_after is None else reply[:close_after], close_after is not None)
    peer.start()
    return RawConnection(Choppy(ours, seed), frame_header=FRAME_OVERHEAD), peer  # type: ignore[arg-type]


def resp_array(values: list[bytes | None]) -> bytes:
    parts = [b"*%d\r\n" % len(values)]
    for v in values:
        parts.append(b"$-1\r\n" if v is None else b"$%d\r\n%s\r\n" % (len(v), v))
    return b"".join(parts)


@pytest.mark.parametrize("seed", range(4))
def test_parser_values_cut_anywhere(seed: int) -> None:
    rng = random.Random(seed)
    values: list[bytes | None] = [None if rng.random() < 0.1 else rng.randbytes(rng.choice([0, 1, 5, 40]))
                                  for _ in range(8000)]
    values += [b"\r\n" * 40_000, None, os.urandom(200_000), b"$-1\r\n" * 3]
    keys = [f"k{i}" for i in range(len(values))]
    conn, t = serve(resp_array(values), seed)
    assert [None if v is None else bytes(v) for v in conn.get_values(keys, mget=True)] == values
    t.join()
    # The same stream split at the frame header: a value that fills its target goes there, others are read past.
    targets = [memoryview(bytearray(max(0, len(v) - FRAME_OVERHEAD) if v is not None and seed % 2 else 3))
               for v in values]
    conn, t = serve(resp_array(values), seed)
    got = conn.get_into(keys, targets, mget=True)
    t.join()
    for v, g, target in zip(values, got, targets, strict=True):
        if v is None:
            assert g is None
            continue
        assert g == (v[:FRAME_OVERHEAD], len(v))
        if len(v) == FRAME_OVERHEAD + target.nbytes:
            assert target == v[FRAME_OVERHEAD:]


def test_parser_refuses_what_is_not_a_get_reply() -> None:
    for reply, mget, error, match in [
        (b"-MOVED 3999 127.0.0.1:6381\r\n", False, redis.ResponseError, "MOVED"),
        (b"*1\r\n:7\r\n", True, InvalidResponse, "bulk string"),
        (b"*2\r\n$-1\r\n$-1\r\n", True, InvalidResponse, "MGET of 1 keys answered 2"),
        (b"$3\r\nabcXY", False, InvalidResponse, "CRLF"),
    ]:
        conn, peer = serve(reply, 0)
        with pytest.raises(error, match=match):
            conn.get_values(["a"], mget=mget)
        peer.join()
        conn.close()


def test_parser_a_reply_cut_short_by_a_closed_connection() -> None:
    reply = resp_array([os.urandom(100_000)])
    for cut in (2, 10, 5000, len(reply) - 1):
        conn, t = serve(reply, cut, close_after=cut)
        with pytest.raises(redis.ConnectionError, match="closed"):
            conn.get_into(["a"], [memoryview(bytearray(100_000 - FRAME_OVERHEAD))], mget=True)
        t.join()

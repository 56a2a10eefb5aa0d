"""Redis stores: one server, or a Cluster addressed node by node.

Every batch is one pipeline per server (a Cluster: one per node the keys map
to, the nodes' pipelines sent at once from a small thread pool, so a batch costs
the slowest node's round trip, not their sum), sent without a transaction.  A server that fails (refused, reset, past
``timeout``, out of memory) fails only its own part of the batch: those keys
miss or their writes answer False, one error is counted, and the server is
skipped for ``backoff`` seconds.  The Cluster client is used for its slot map
only, so a dead node never stalls the batches of the live ones; run the nodes
with ``cluster-require-full-coverage no`` so the live ones keep answering.

Reads skip redis-py: :mod:`kvcore_redis.resp` sends ``MGET`` (a Cluster node: pipelined
``GET``) on a socket of its own per thread and reads each value straight into its
destination, so ``batch_get_views`` costs one read off the socket and the CRC pass (the
views of one call share one block of memory: a view kept keeps its batch's block), and
``batch_get_into`` puts each payload into the caller's buffer with no copy in between.
Writes, ``EXISTS``, ``SCAN`` and ``CLUSTER SLOTS`` go through redis-py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit

import redis
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.retry import Retry

from kvcore.stores import FRAME_OVERHEAD, KVStore, StoreURL
from kvcore_redis.config import RedisOptions
from kvcore_redis.packer import ZeroCopyPacker
from kvcore_redis.resp import RawConnection, RawPool

__all__ = ["RedisStore", "RedisClusterStore"]

_SLOTS = 16384
# Threads that send one batch's per-node pipelines at once (a Cluster of more masters queues the rest).
_MAX_PARALLEL_NODES = 16
# Everything kvcore writes starts with this; clear() deletes only these keys.
_KVCORE_KEYS = "kvcore*"


def _client(host: str, port: int, opts: RedisOptions, **more: Any) -> redis.Redis:
    pool = redis.ConnectionPool(
        host=host, port=port,
        # No client-side retries: a retry multiplies the time a dead server costs, and a miss is cheap.
        socket_timeout=opts.timeout, socket_connect_timeout=opts.timeout, retry=Retry(NoBackoff(), 0),
        health_check_interval=0,
        # Pages are large (tens to hundreds of KiB): fewer, larger reads, and no copy of a value into the command.
        socket_read_size=1 << 20, command_packer=ZeroCopyPacker(),
        **more,
    )
    return redis.Redis(connection_pool=pool)


def _host_port(text: str, url: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{text!r} is not host:port (in {url!r})")
    return host.strip("[]"), int(port)


def _raw_pool(host: str, port: int, opts: RedisOptions, db: int = 0,
              username: str | None = None, password: str | None = None) -> RawPool:
    return RawPool(lambda: RawConnection.connect(host, port, opts.timeout, db, username, password,
                                                 frame_header=FRAME_OVERHEAD))


class _Node:
    """One server's clients (redis-py's, and the read path's sockets) and when it may be tried again."""

    __slots__ = ("name", "client", "raw", "retry_at")

    def __init__(self, name: str, client: redis.Redis, raw: RawPool) -> None:
        self.name = name
        self.client = client
        self.raw = raw
        self.retry_at = 0.0


class _RedisBase(KVStore):
    """What both stores share: per-node pipelines, per-node failure and backoff."""

    def __init__(self, url: str, opts: RedisOptions) -> None:
        super().__init__(url, opts.ttl)
        self.options = opts
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None  # made on the first batch that spans two nodes

    def _groups(self, keys: list[str]) -> list[tuple[_Node, list[int]]]:
        """The keys' positions grouped by the node that holds them."""
        raise NotImplementedError

    def _all_nodes(self) -> list[_Node]:
        raise NotImplementedError

    def _round_trips(self, keys: list[str]) -> int:
        now = time.monotonic()
        return sum(1 for node, _ in self._groups(keys) if node.retry_at <= now) if keys else 1

    def _per_node(self, what: str, keys: list[str], miss: Any,
                  run: Callable[[_Node, list[str], list[int]], Sequence[Any]]) -> list[Any]:
        out: list[Any] = [miss] * len(keys)
        now = time.monotonic()
        todo = []
        for node, idx in self._groups(keys):
            if node.retry_at > now:
                self._failed(what, ConnectionError(f"{node.name} failed less than backoff={self.options.backoff}s ago"))
            else:
                todo.append((node, idx))

        def one(node: _Node, idx: list[int]) -> Sequence[Any] | None:
            try:
                return run(node, [keys[i] for i in idx], idx)
            except (redis.RedisError, OSError) as exc:
                node.retry_at = time.monotonic() + self.options.backoff
                self._failed(what, exc)
                return None

        if len(todo) > 1:
            # Each node's client has its own connection pool: the pipelines go out at once.
            results = list(self._executor().map(lambda group: one(*group), todo))
        else:
            results = [one(node, idx) for node, idx in todo]
        for (_, idx), got in zip(todo, results, strict=True):
            if got is not None:
                for i, v in zip(idx, got, strict=True):
                    out[i] = v
        return out

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(_MAX_PARALLEL_NODES, thread_name_prefix="kvcore-redis")
            return self._pool

    def _exists(self, keys: list[str]) -> list[bool]:
        def run(node: _Node, ks: list[str], _: list[int]) -> list[bool]:
            pipe = node.client.pipeline(transaction=False)
            for k in ks:
                pipe.exists(k)
            return [bool(n) for n in pipe.execute()]

        return self._per_node("exists", keys, False, run)

    #: Reads are one MGET per server; a Cluster node takes MGET of one slot only and is sent GETs.
    _mget = True

    def _get(self, keys: list[str]) -> list[bytes | None]:
        return [None if v is None else bytes(v) for v in self._get_buffers(keys)]

    def _get_buffers(self, keys: list[str]) -> list[memoryview | None]:
        def run(node: _Node, ks: list[str], _: list[int]) -> list[memoryview | None]:
            with node.raw.connection() as conn:
                return conn.get_values(ks, self._mget)

        return self._per_node("get", keys, None, run)

    def _get_into(self, keys: list[str], targets: list[memoryview]) -> list[tuple[bytes, int] | None]:
        def run(node: _Node, ks: list[str], idx: list[int]) -> list[tuple[bytes, int] | None]:
            with node.raw.connection() as conn:
                return conn.get_into(ks, [targets[i] for i in idx], self._mget)

        return self._per_node("get", keys, None, run)

    def _set(self, keys: list[str], values: list[bytes]) -> list[bool]:
        px = None if self.ttl is None else max(1, int(self.ttl * 1000))

        def run(node: _Node, ks: list[str], idx: list[int]) -> list[bool]:
            pipe = node.client.pipeline(transaction=False)
            for k, i in zip(ks, idx, strict=True):
                pipe.set(k, values[i], px=px)
            replies = pipe.execute(raise_on_error=False)
            refused = [r for r in replies if isinstance(r, Exception)]
            if refused:
                # A full server (maxmemory with noeviction) refuses some writes: those are False.
                self._failed("set", refused[0])
            return [r is True for r in replies]

        return self._per_node("set", keys, False, run)

    def _clear(self) -> None:
        for node in self._all_nodes():
            # One UNLINK per key, pipelined: a cluster node refuses a multi-key UNLINK across slots.
            pipe = node.client.pipeline(transaction=False)
            for n, key in enumerate(node.client.scan_iter(match=_KVCORE_KEYS, count=1000), 1):
                pipe.unlink(key)
                if n % 1000 == 0:
                    pipe.execute()
            pipe.execute()

    def _close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        for node in self._all_nodes():
            node.client.close()
            node.raw.close()


class RedisStore(_RedisBase):
    """``redis://[user:password@]host:port[/db][?timeout=S&ttl=S&backoff=S]``: one server."""

    def __init__(self, url: str, host: str, port: int, db: int, opts: RedisOptions,
                 username: str | None = None, password: str | None = None) -> None:
        super().__init__(url, opts)
        client = _client(host, port, opts, db=db, username=username, password=password)
        raw = _raw_pool(host, port, opts, db, username, password)
        self._node = _Node(f"{host}:{port}", client, raw)

    @classmethod
    def from_url(cls, url: StoreURL) -> RedisStore:
        parts = urlsplit(url.url)
        host, port = parts.hostname, parts.port or 6379
        if not host:
            raise ValueError("write redis://host:port/db")
        db_text = url.path.strip("/") or "0"
        if not db_text.isdigit():
            raise ValueError(f"the database is a number (redis://host:port/0), got {db_text!r}")
        return cls(url.url, host, port, int(db_text), url.options_as(RedisOptions),
                   parts.username or None, parts.password)

    @property
    def client(self) -> redis.Redis:
        """The redis-py client (tests write raw bytes with it)."""
        return self._node.client

    def corrupt(self, key: str, data: bytes) -> None:
        """Write raw ``data`` (no frame) under ``key``, as a foreign writer would."""
        self.client.set(key, data)

    def _groups(self, keys: list[str]) -> list[tuple[_Node, list[int]]]:
        return [(self._node, list(range(len(keys))))]

    def _all_nodes(self) -> list[_Node]:
        return [self._node]


class RedisClusterStore(_RedisBase):
    """``redis+cluster://host:port[,host:port...][?timeout=S&ttl=S&backoff=S]``: a Redis Cluster.

    The slot map comes from ``CLUSTER SLOTS`` of the first node of the list (or one
    learnt since) that answers; keys go to their slot's master over a plain client
    per node.  A ``MOVED`` reply (the cluster was resharded) drops the map, so the
    next call reads it again.
    """

    def __init__(self, url: str, nodes: list[tuple[str, int]], opts: RedisOptions) -> None:
        super().__init__(url, opts)
        self._startup = [f"{h}:{p}" for h, p in nodes]
        self._nodes: dict[str, _Node] = {}
        self._slots: list[str] | None = None  # slot -> "host:port" of its master

    @classmethod
    def from_url(cls, url: StoreURL) -> RedisClusterStore:
        if url.path not in ("", "/"):
            raise ValueError("a cluster has one keyspace: write redis+cluster://host:port,host:port (no /db)")
        if not url.netloc:
            raise ValueError("write redis+cluster://host:port[,host:port...]")
        nodes = [_host_port(part, url.url) for part in url.netloc.split(",") if part]
        return cls(url.url, nodes, url.options_as(RedisOptions))

    def _node(self, name: str) -> _Node:
        node = self._nodes.get(name)
        if node is None:
            host, _, port = name.rpartition(":")
            client = _client(host, int(port), self.options)
            node = self._nodes.setdefault(name, _Node(name, client, _raw_pool(host, int(port), self.options)))
        return node

    def _slot_map(self) -> list[str]:
        """Slot -> master; read lazily (opening never fails because the cluster is down)."""
        with self._lock:
            if self._slots is not None:
                return self._slots
            last: Exception | None = None
            for name in dict.fromkeys([*self._startup, *self._nodes]):
                node = self._node(name)
                try:
                    ranges = node.client.execute_command("CLUSTER SLOTS")
                except (redis.RedisError, OSError) as exc:
                    last = exc
                    continue
                slots = [""] * _SLOTS
                for lo, hi, master, *_ in ranges:
                    host = master[0].decode() if isinstance(master[0], bytes) else str(master[0])
                    slots[lo : hi + 1] = [f"{host or node.name.rpartition(':')[0]}:{master[1]}"] * (hi - lo + 1)
                self._slots = slots
                return slots
            raise redis.ConnectionError(f"no node of {', '.join(self._startup)} answered CLUSTER SLOTS ({last})")

    def node_of(self, key: str) -> str:
        """``host:port`` of the master that holds ``key``."""
        return self._slot_map()[key_slot(key.encode("utf-8"))]

    def client_for(self, key: str) -> redis.Redis:
        """The client of the master that holds ``key`` (tests write raw bytes with it)."""
        return self._node(self.node_of(key)).client

    def corrupt(self, key: str, data: bytes) -> None:
        self.client_for(key).set(key, data)

    def _per_node(self, what: str, keys: list[str], miss: Any,
                  run: Callable[[_Node, list[str], list[int]], Sequence[Any]]) -> list[Any]:
        def guarded(node: _Node, ks: list[str], idx: list[int]) -> Sequence[Any]:
            try:
                return run(node, ks, idx)
            except redis.ResponseError as exc:
                if str(exc).startswith(("MOVED", "ASK")):
                    self._slots = None  # resharded: read the map again next time
                raise

        return super()._per_node(what, keys, miss, guarded)

    # MGET on a cluster node needs one slot: pipelined GETs are still one round trip per node.
    _mget = False

    def _groups(self, keys: list[str]) -> list[tuple[_Node, list[int]]]:
        slots = self._slot_map()
        groups: dict[str, tuple[_Node, list[int]]] = {}
        for i, k in enumerate(keys):
            name = slots[key_slot(k.encode("utf-8"))]
            entry = groups.get(name)
            if entry is None:
                entry = groups[name] = (self._node(name), [])
            entry[1].append(i)
        return list(groups.values())

    def _all_nodes(self) -> list[_Node]:
        if self._slots is None:
            return []
        return [self._node(n) for n in dict.fromkeys(self._slots) if n]

    def _close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        for node in self._nodes.values():
            node.client.close()
            node.raw.close()

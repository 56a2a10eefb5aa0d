"""Real ``redis-server`` processes on 127.0.0.1 for tests and benchmarks: one server, or a Cluster.

Debian's ``redis-server`` and ``redis-cli`` must be on PATH (``.ci/run`` installs
them).  Each server runs in the foreground of a child process, with its data
directory under a directory the caller gives (a pytest ``tmp_path``), no
persistence, and is stopped by :meth:`RedisServer.stop` (SIGTERM, then SIGKILL).
Every wait is a bounded loop.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import redis

__all__ = ["RedisServer", "RedisClusterServers", "free_port", "redis_server_missing"]


def redis_server_missing() -> str | None:
    """Why real servers cannot run here (None when ``redis-server`` and ``redis-cli`` are on PATH)."""
    missing = [b for b in ("redis-server", "redis-cli") if shutil.which(b) is None]
    return f"{' and '.join(missing)} not on PATH (apt-get install redis-server redis-tools)" if missing else None


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(bus: bool = False) -> int:
    """A free loopback port; with ``bus`` one whose cluster bus port (``port + 10000``) is free too."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if not bus or (port + 10000 < 65536 and _port_free(port + 10000)):
            return port
    raise RuntimeError("no free loopback port found in 200 tries")


def _wait(check: Callable[[], object], what: str, deadline_s: float = 20.0) -> None:
    end = time.monotonic() + deadline_s
    while True:
        try:
            if check():
                return
        except (redis.RedisError, OSError):
            pass
        if time.monotonic() > end:
            raise RuntimeError(f"{what} did not happen within {deadline_s}s")
        time.sleep(0.05)


class RedisServer:
    """One ``redis-server`` on ``127.0.0.1:port`` with its data in ``dir``; ``args`` are extra config lines;
    ``password``: clients must ``AUTH`` with it (``client()`` does)."""

    def __init__(self, dir: str | os.PathLike[str], port: int | None = None, args: Sequence[str] = (),
                 password: str | None = None) -> None:
        self.dir = Path(dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port(bus=any(a == "--cluster-enabled" for a in args))
        self.args = list(args)
        self.password = password
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def client(self, timeout: float = 5.0) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=timeout, password=self.password)

    def start(self) -> RedisServer:
        cmd = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
               "--save", "", "--appendonly", "no", "--daemonize", "no", "--protected-mode", "no",
               "--logfile", str(self.dir / "redis.log"), *self.args,
               *(["--requirepass", self.password] if self.password is not None else [])]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)

        def up() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                log = (self.dir / "redis.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"redis-server on port {self.port} exited: {log}")
            with self.client(timeout=0.5) as c:
                return bool(c.ping())

        _wait(up, f"redis-server on port {self.port} answering PING")
        return self

    def kill(self) -> None:
        """SIGKILL: the server dies as in a crash (what it held in memory is gone)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def pause(self) -> None:
        """SIGSTOP: the server holds its connections but answers nothing (a stalled server)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 10 s."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class RedisClusterServers:
    """A Cluster of ``masters`` masters (no replicas) on loopback, made with ``redis-cli --cluster create``.

    The nodes run with ``cluster-require-full-coverage no``, so when one node is
    down the others keep serving their slots.
    """

    def __init__(self, dir: str | os.PathLike[str], masters: int = 3, node_timeout_ms: int = 2000) -> None:
        self.dir = Path(dir)
        args = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(node_timeout_ms), "--cluster-require-full-coverage", "no"]
        self.nodes: list[RedisServer] = []
        ports: set[int] = set()
        for i in range(masters):
            port = free_port(bus=True)
            while port in ports or port + 10000 in ports or port - 10000 in ports:
                port = free_port(bus=True)
            ports.add(port)
            self.nodes.append(RedisServer(self.dir / f"node{i}", port, args))

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(n.address for n in self.nodes)

    def start(self) -> RedisClusterServers:
        try:
            for n in self.nodes:
                n.start()
            subprocess.run(
                ["redis-cli", "--cluster", "create", *(n.address for n in self.nodes),
                 "--cluster-replicas", "0", "--cluster-yes"],
                check=True, capture_output=True, timeout=60,
            )
            self.wait_ok()
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ok(self, nodes: Sequence[RedisServer] | None = None) -> None:
        """Until every node (or ``nodes``) reports ``cluster_state:ok`` and knows every other."""
        def ok() -> bool:
            for n in nodes or self.nodes:
                with n.client(timeout=0.5) as c:
                    info = c.cluster("info")
                    if info.get("cluster_state") != "ok" or int(info.get("cluster_known_nodes", 0)) != len(self.nodes):
                        return False
            return True

        _wait(ok, "cluster_state:ok on every node", deadline_s=60)

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()

    def __enter__(self) -> RedisClusterServers:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

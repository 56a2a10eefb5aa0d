"""``memory://[name]``: an in-process store, bounded by ``?max_bytes=`` (LRU), with ``?ttl=`` seconds.

``memory://`` is private to the object; ``memory://name`` is shared by every
store opened with that name in this process (several caches of one process
sharing one store, as engines share a Redis).

``batch_get_views`` answers views of the stored frames themselves (immutable
``bytes``: an overwrite stores a new object, so a view never changes under its
holder); ``batch_get_into`` copies each payload once, into the caller's buffer.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

from pydantic import BaseModel, ConfigDict, Field

from kvcore.stores.base import KVStore
from kvcore.stores.registry import StoreURL

__all__ = ["MemoryStore", "MemoryOptions"]


class MemoryOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_bytes: int | None = Field(None, gt=0, description="bytes kept (framed values); least recently used go first")
    ttl: float | None = Field(None, gt=0, description="seconds a value lives")


class _Space:
    """The map behind one memory store (shared by name)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.values: OrderedDict[str, tuple[bytes, float | None]] = OrderedDict()
        self.nbytes = 0


_named: dict[str, _Space] = {}
_named_lock = threading.Lock()


class MemoryStore(KVStore):
    def __init__(self, url: str, *, name: str = "", max_bytes: int | None = None, ttl: float | None = None) -> None:
        super().__init__(url, ttl)
        self.max_bytes = max_bytes
        if name:
            with _named_lock:
                self._space = _named.setdefault(name, _Space())
        else:
            self._space = _Space()

    @classmethod
    def from_url(cls, url: StoreURL) -> MemoryStore:
        if url.path not in ("", "/"):
            raise ValueError("a memory store takes a name, not a path: memory://NAME")
        opts = url.options_as(MemoryOptions)
        return cls(url.url, name=url.netloc, max_bytes=opts.max_bytes, ttl=opts.ttl)

    def _live(self, key: str, now: float) -> bytes | None:
        entry = self._space.values.get(key)
        if entry is None:
            return None
        data, expires = entry
        if expires is not None and expires <= now:
            self._drop(key)
            return None
        self._space.values.move_to_end(key)
        return data

    def _drop(self, key: str) -> None:
        data, _ = self._space.values.pop(key)
        self._space.nbytes -= len(data)

    def _exists(self, keys: list[str]) -> list[bool]:
        now = time.monotonic()
        with self._space.lock:
            return [self._live(k, now) is not None for k in keys]

    def _get(self, keys: list[str]) -> list[bytes | None]:
        now = time.monotonic()
        with self._space.lock:
            return [self._live(k, now) for k in keys]

    def _set(self, keys: list[str], values: list[bytes]) -> list[bool]:
        expires = None if self.ttl is None else time.monotonic() + self.ttl
        space = self._space
        out = []
        with space.lock:
            for k, v in zip(keys, values, strict=True):
                if self.max_bytes is not None and len(v) > self.max_bytes:
                    out.append(False)
                    continue
                if k in space.values:
                    self._drop(k)
                space.values[k] = (v, expires)
                space.nbytes += len(v)
                while self.max_bytes is not None and space.nbytes > self.max_bytes:
                    self._drop(next(iter(space.values)))
                out.append(True)
        return out

    def _clear(self) -> None:
        with self._space.lock:
            self._space.values.clear()
            self._space.nbytes = 0

    def corrupt(self, key: str, data: bytes) -> None:
        """Put raw ``data`` (no frame) under ``key``: what a foreign writer or a bit flip leaves (tests)."""
        with self._space.lock:
            if key in self._space.values:
                self._drop(key)
            self._space.values[key] = (data, None)
            self._space.nbytes += len(data)

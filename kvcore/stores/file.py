"""``file:///dir``: one file per key under a directory, with ``?ttl=`` seconds (by modification time).

Writes go to a temporary file and ``os.replace`` it into place, so concurrent
writers of one key (threads or processes) leave one whole value, never a mix.
Keys are hashed into file names (a key may hold any character).

``batch_get_into`` reads a payload straight from the file into the caller's
buffer (``readinto``), with no copy in between; ``batch_get_views`` answers
views of the bytes read from the file.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from kvcore.stores.base import KVStore
from kvcore.stores.framing import FRAME_OVERHEAD
from kvcore.stores.registry import StoreURL

__all__ = ["FileStore", "FileOptions"]


class FileOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    ttl: float | None = Field(None, gt=0, description="seconds a value lives (files older than this are misses)")


class FileStore(KVStore):
    def __init__(self, url: str, root: str | os.PathLike[str], *, ttl: float | None = None) -> None:
        super().__init__(url, ttl)
        self.root = Path(root)
        # A missing directory is made on first write; one that cannot be made is a store failure then.

    @classmethod
    def from_url(cls, url: StoreURL) -> FileStore:
        if url.netloc not in ("", "localhost"):
            raise ValueError("a file store is local: write file:///absolute/dir")
        if not url.path or url.path == "/":
            raise ValueError("a file store needs a directory: file:///absolute/dir")
        opts = url.options_as(FileOptions)
        return cls(url.url, url.path, ttl=opts.ttl)

    def path_of(self, key: str) -> Path:
        """Where ``key``'s value lives (tests corrupt it there)."""
        digest = hashlib.sha256(key.encode("utf-8")).hexdigest()
        return self.root / digest[:2] / digest[2:]

    def _fresh(self, path: Path) -> bool:
        mtime = path.stat().st_mtime  # FileNotFoundError: absent
        return self.ttl is None or time.time() - mtime < self.ttl

    def _exists(self, keys: list[str]) -> list[bool]:
        out = []
        for k in keys:
            p = self.path_of(k)
            try:
                out.append(self._fresh(p))
            except FileNotFoundError:
                out.append(False)
        return out

    def _get(self, keys: list[str]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for k in keys:
            p = self.path_of(k)
            try:
                out.append(p.read_bytes() if self._fresh(p) else None)
            except FileNotFoundError:
                out.append(None)
        return out

    def _get_into(self, keys: list[str], targets: list[memoryview]) -> list[tuple[bytes, int] | None]:
        out: list[tuple[bytes, int] | None] = []
        for k, target in zip(keys, targets, strict=True):
            try:
                with open(self.path_of(k), "rb", buffering=0) as f:
                    st = os.fstat(f.fileno())
                    if self.ttl is not None and time.time() - st.st_mtime >= self.ttl:
                        out.append(None)
                        continue
                    header = f.read(FRAME_OVERHEAD)
                    if st.st_size == FRAME_OVERHEAD + target.nbytes:
                        done = 0
                        while done < target.nbytes:
                            n = f.readinto(target[done:])
                            if not n:
                                break  # the file shrank under us: the size no longer holds
                            done += n
                        size = st.st_size if done == target.nbytes else FRAME_OVERHEAD + done
                    else:
                        size = st.st_size
            except FileNotFoundError:
                out.append(None)
                continue
            out.append((header, size))
        return out

    def _set(self, keys: list[str], values: list[bytes]) -> list[bool]:
        out = []
        for k, v in zip(keys, values, strict=True):
            p = self.path_of(k)
            p.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=".tmp-")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(v)
                os.replace(tmp, p)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
            out.append(True)
        return out

    def _clear(self) -> None:
        if self.root.is_dir():
            for child in self.root.iterdir():
                if child.is_dir():
                    shutil.rmtree(child, ignore_errors=True)

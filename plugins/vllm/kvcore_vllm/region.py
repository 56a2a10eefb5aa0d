"""The host tier's bytes: one shared-memory file that the scheduler's manager and the worker both map.

vLLM runs the scheduler and the worker in one process or in two, depending on
the executor; a file under ``/dev/shm`` (named by the engine id and the worker
rank) is the same memory either way.  The manager writes the blocks it read from
the store and checked; the worker copies blocks between vLLM's KV tensors and it.
Whichever side opens it first creates it; each side unlinks it when it shuts
down (the mapping stays valid for the other), and an engine that dies leaves a
file named by its engine id, nothing else.
"""

from __future__ import annotations

import mmap
import os
import re
import tempfile
from pathlib import Path

import torch

__all__ = ["HostRegion", "region_path"]


def region_path(engine_id: str, rank: int) -> Path:
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", engine_id)
    return base / f"kvcore_vllm_{safe}_r{rank}.host"


class HostRegion:
    """``rows`` rows of ``row_bytes`` bytes (row 0 is padding, as slot 0 of the books)."""

    def __init__(self, path: Path, rows: int, row_bytes: int) -> None:
        self.path = path
        self.rows = rows
        self.row_bytes = row_bytes
        size = rows * row_bytes
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < size:
                os.ftruncate(fd, size)
            self._mm: mmap.mmap | None = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.data: torch.Tensor = torch.frombuffer(self._mm, dtype=torch.uint8).view(rows, row_bytes)

    def close(self) -> None:
        """Unmap and unlink (the other side keeps its own mapping)."""
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        mm, self._mm = self._mm, None
        self.data = torch.empty((0, self.row_bytes), dtype=torch.uint8)
        if mm is not None:
            try:
                mm.close()
            except BufferError:  # a view of it is still alive somewhere: the OS unmaps it at exit
                pass

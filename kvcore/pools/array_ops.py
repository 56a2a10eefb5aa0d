"""The array operations a pool runs on, in two forms: numpy views on the CPU, torch elsewhere.

A pool picks its form once, at construction (:func:`ops_for`).  The free-page ring,
the ownership claims and the batch allocation are written once over
:class:`ArrayOps`; they hold their maps as *native* arrays (numpy views that share
the torch tensors' memory, or the tensors themselves) and speak torch only at the
allocator's public methods.  On the CPU a numpy op costs a fraction of a torch op's
dispatch at these sizes, which is why there are two forms at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["Array", "ArrayOps", "NumpyOps", "TorchOps", "ops_for"]

#: A 1-D integer array of the pool's form: ``np.ndarray`` (NumpyOps) or ``torch.Tensor`` (TorchOps).
Array = Any


class ArrayOps:
    """The primitives the pool code needs beyond what numpy and torch spell alike
    (indexing, slicing, arithmetic, comparisons, ``len``, ``reshape``)."""

    def view(self, t: torch.Tensor) -> Array:
        """``t`` (on this pool's device) as a native array sharing its memory."""
        raise NotImplementedError

    def tensor(self, a: Array) -> torch.Tensor:
        """A native array as a torch tensor (sharing memory where it can)."""
        raise NotImplementedError

    def ints(self, x: Any) -> Array:
        """Lengths or slot ids given as a tensor or a sequence: a native 1-D int64 array."""
        raise NotImplementedError

    def of(self, values: list[int]) -> Array:
        """A native int64 array of plain ints the pool code computed itself (no checks)."""
        raise NotImplementedError

    def arange(self, start: int, stop: int) -> Array:
        raise NotImplementedError

    def copy(self, a: Array) -> Array:
        raise NotImplementedError

    def cat(self, parts: Sequence[Array]) -> Array:
        """The parts joined (an empty int64 array for none)."""
        raise NotImplementedError

    def unique(self, a: Array) -> Array:
        """The distinct values, ascending."""
        raise NotImplementedError

    def cumsum(self, a: Array) -> Array:
        raise NotImplementedError

    def repeat(self, a: Array, counts: Array, total: int) -> Array:
        """Each ``a[i]`` ``counts[i]`` times (``total`` = the sum of the counts)."""
        raise NotImplementedError

    def sort(self, a: Array) -> Array:
        raise NotImplementedError

    def nonzero(self, a: Array) -> Array:
        """Positions of the non-zero entries, ascending."""
        raise NotImplementedError

    def count_nonzero(self, a: Array) -> int:
        raise NotImplementedError

    def any_outside(self, a: Array, lo: int, hi: int) -> bool:
        """Whether some value of ``a`` (non-empty) lies outside ``[lo, hi)``."""
        raise NotImplementedError

    def stamp(self, table: Array, idx: Array) -> bool:
        """Write 1, 2, ..., k at ``table[idx]`` and read them back.

        True iff every position reads its own stamp, that is iff no index is named
        twice (two positions of one index hold one stamp).  The stamps stay written.
        """
        raise NotImplementedError

    def run_start(self, a: Array) -> int:
        """``a0`` when ``a`` (non-empty) is exactly ``a0, a0 + 1, ..., a0 + k - 1``, else -1.

        What alloc_extend usually hands out: a pool whose form finds runs cheaply checks
        them as one slice.  -1 (no run) is always a correct answer: the caller then takes
        the general path, which is where every refusal is raised anyway.
        """
        return -1


def _integer_dtype(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def cpu_ints(x: Any) -> np.ndarray:
    """``x`` (a tensor on any device, a sequence of ints) as a host 1-D int64 numpy array.

    TypeError for floating, complex or bool values: a length or slot id is an integer.
    """
    if type(x) is list and all(type(v) is int for v in x):
        return np.array(x, dtype=np.int64)
    if isinstance(x, np.ndarray) and x.dtype.kind in "iu":
        return x.astype(np.int64, copy=False).reshape(-1)
    if not isinstance(x, torch.Tensor):
        x = torch.as_tensor(list(x))
    if not _integer_dtype(x.dtype):
        raise TypeError(f"expected integers, got dtype {x.dtype}")
    x = x.detach()
    if x.device.type == "cpu" and x.dtype == torch.int64:
        return x.numpy().reshape(-1)
    return x.to(device="cpu", dtype=torch.int64).numpy().reshape(-1)


class NumpyOps(ArrayOps):
    """A CPU pool: maps read and written through numpy views of their tensors."""

    def __init__(self) -> None:
        self._stamps = np.arange(1, 1, dtype=np.int32)
        self._stamp_bytes = b""
        self._iota_bytes = b""  # 0, 1, 2, ... as int64 bytes: a run minus its first value reads so
        self._scratch = np.empty(0, dtype=np.int64)

    def view(self, t: torch.Tensor) -> np.ndarray:
        return t.numpy()

    def tensor(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a)

    def ints(self, x: Any) -> np.ndarray:
        return cpu_ints(x)

    def of(self, values: list[int]) -> np.ndarray:
        return np.array(values, dtype=np.int64)

    def arange(self, start: int, stop: int) -> np.ndarray:
        return np.arange(start, stop, dtype=np.int64)

    def copy(self, a: np.ndarray) -> np.ndarray:
        return a.copy()

    def cat(self, parts: Sequence[np.ndarray]) -> np.ndarray:
        if len(parts) == 1:
            return parts[0]
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)

    def unique(self, a: np.ndarray) -> np.ndarray:
        # Sort and keep the first of each run: np.unique costs several times more at these sizes.
        q = np.sort(a)
        if q.size > 1:
            keep = np.empty(q.size, dtype=bool)
            keep[0] = True
            np.not_equal(q[1:], q[:-1], out=keep[1:])
            q = q[keep]
        return q

    def cumsum(self, a: np.ndarray) -> np.ndarray:
        return np.cumsum(a)

    def repeat(self, a: np.ndarray, counts: np.ndarray, total: int) -> np.ndarray:
        return np.repeat(a, counts)

    def sort(self, a: np.ndarray) -> np.ndarray:
        return np.sort(a)

    def nonzero(self, a: np.ndarray) -> np.ndarray:
        return np.flatnonzero(a)

    def count_nonzero(self, a: np.ndarray) -> int:
        return int(np.count_nonzero(a))

    def any_outside(self, a: np.ndarray, lo: int, hi: int) -> bool:
        # As unsigned, a value below lo becomes huge: one max bounds both ends.
        return bool((a - lo).view(np.uint64).max() >= hi - lo)

    def stamp(self, table: np.ndarray, idx: np.ndarray) -> bool:
        k = idx.size
        if self._stamps.size < k:
            self._stamps = np.arange(1, max(k, 2 * self._stamps.size, 1024) + 1, dtype=np.int32)
            self._stamp_bytes = self._stamps.tobytes()
        table[idx] = self._stamps[:k]
        return bool(table[idx].tobytes() == self._stamp_bytes[: 4 * k])

    def run_start(self, a: np.ndarray) -> int:
        # Two scalar reads reject most non-runs; a run is then confirmed by one subtract into
        # scratch and one memcmp against 0, 1, 2, ... (cheaper than diff/array_equal's temporaries).
        k = a.size
        a0 = a.item(0)
        if a.item(k - 1) - a0 != k - 1 or a.dtype != np.int64:
            return -1
        if k <= 2:
            return a0
        if self._scratch.size < k:
            n = max(k, 2 * self._scratch.size, 1024)
            self._scratch = np.empty(n, dtype=np.int64)
            self._iota_bytes = np.arange(n, dtype=np.int64).tobytes()
        d = np.subtract(a, a0, out=self._scratch[:k])
        return a0 if d.tobytes() == self._iota_bytes[: 8 * k] else -1


class TorchOps(ArrayOps):
    """A pool on an accelerator (or a CPU pool asked to run in torch): every map a tensor."""

    def __init__(self, device: str | torch.device) -> None:
        self.device = torch.device(device)
        self._stamps = torch.arange(1, 1, dtype=torch.int32, device=self.device)

    def view(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def tensor(self, a: torch.Tensor) -> torch.Tensor:
        return a

    def ints(self, x: Any) -> torch.Tensor:
        if isinstance(x, torch.Tensor) and not _integer_dtype(x.dtype):
            raise TypeError(f"expected integers, got dtype {x.dtype}")
        t = torch.as_tensor(x, dtype=torch.int64, device=self.device).reshape(-1)
        if not isinstance(x, torch.Tensor) and len(x) and not all(isinstance(v, int) for v in x):
            cpu_ints(x)  # raises, naming the dtype, when the values are not integers
        return t

    def of(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def arange(self, start: int, stop: int) -> torch.Tensor:
        return torch.arange(start, stop, dtype=torch.int64, device=self.device)

    def copy(self, a: torch.Tensor) -> torch.Tensor:
        return a.clone()

    def cat(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        if len(parts) == 1:
            return parts[0]
        return torch.cat(tuple(parts)) if parts else torch.empty(0, dtype=torch.int64, device=self.device)

    def unique(self, a: torch.Tensor) -> torch.Tensor:
        return torch.unique(a)

    def cumsum(self, a: torch.Tensor) -> torch.Tensor:
        return torch.cumsum(a, 0)

    def repeat(self, a: torch.Tensor, counts: torch.Tensor, total: int) -> torch.Tensor:
        return torch.repeat_interleave(a, counts, output_size=total)  # output_size: no device read-back

    def sort(self, a: torch.Tensor) -> torch.Tensor:
        return torch.sort(a).values

    def nonzero(self, a: torch.Tensor) -> torch.Tensor:
        return a.nonzero().flatten()

    def count_nonzero(self, a: torch.Tensor) -> int:
        return int(torch.count_nonzero(a))

    def any_outside(self, a: torch.Tensor, lo: int, hi: int) -> bool:
        amin, amax = (int(v) for v in torch.aminmax(a))
        return amin < lo or amax >= hi

    def stamp(self, table: torch.Tensor, idx: torch.Tensor) -> bool:
        k = idx.numel()
        if self._stamps.numel() < k:
            n = max(k, 2 * self._stamps.numel(), 1024)
            self._stamps = torch.arange(1, n + 1, dtype=torch.int32, device=self.device)
        stamps = self._stamps[:k]
        table[idx] = stamps
        return torch.equal(table[idx], stamps)


def ops_for(device: str | torch.device) -> ArrayOps:
    """The form a pool on ``device`` runs in: numpy views on the CPU, torch elsewhere."""
    return NumpyOps() if torch.device(device).type == "cpu" else TorchOps(device)

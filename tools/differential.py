"""The base of every differential harness: an SGLang object and a kvcore object driven in lockstep.

A harness subclasses :class:`Harness` and writes only what differs: how its two sides are
built, its operations (each compares what it answered, and the state after it), and its
``operation`` (one random operation of a run).  The base holds what every one shares:

* the seeded ``rng`` and the log of operations; :meth:`Harness.fail` raises a
  :class:`Mismatch` that names the seed, the operation index and the last operations;
* :meth:`Harness.run`: ``operation`` ``n_ops`` times (with ``compare_after_op``, a
  :meth:`Harness.compare` after each), then ``drain``; an error on either side comes back
  as a :class:`Mismatch` with the same report;
* the slot pairing made at allocation time (our slot -> SGLang's), so that two allocators'
  free-list orders need not agree (:meth:`Harness.pair_slots`, :meth:`Harness.mapped`,
  :meth:`Harness.place_slots`), and the locks the test holds itself (:meth:`Harness.hold`,
  :meth:`Harness.release_held`);
* comparison helpers: :meth:`Harness.eq`, :meth:`Harness.eq_rows` with :func:`tree_rows`
  (canonical trees, reported as ours-only / sglang-only rows), :func:`path_tokens`,
  :func:`lru_order`, the free-list readers, and the deterministic :class:`Clock` both sides read.

The sliding-window request lifecycle both window harnesses drive is
:mod:`tools.window_differential`.
"""

from __future__ import annotations

import random
import time
import types
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pytest
import torch

from kvcore.tree import iter_subtree

__all__ = ["Clock", "Harness", "Mismatch", "ids", "load_or_skip", "lru_order", "our_free_pages", "path_tokens",
           "sglang_free_pages", "tree_rows", "window_prompts"]


class Mismatch(AssertionError):
    """Ours and SGLang's answered differently (or one side failed)."""


def ids(tokens: Iterable[Any]) -> tuple[int, ...]:
    """Token ids (or slots) as a tuple of ints, for a canonical row."""
    return tuple(int(t) for t in tokens)


def load_or_skip(load: Callable[..., Any], src: str | None, what: str, **kw: Any) -> Any:
    """``load(src, **kw)``; when SGLang's classes do not load there, the calling test module skips, saying why."""
    try:
        return load(src, **kw)
    except Exception as exc:  # noqa: BLE001 - any failure to load SGLang means: nothing to compare against
        pytest.skip(f"cannot load SGLang's {what} from {src}: {type(exc).__name__}: {exc}")


def our_free_pages(alloc: Any) -> list[int]:
    """kvcore's free list as SGLang keeps its own: slot ids at page size 1, page ids above."""
    pages = alloc.free_slots()
    if alloc.page_size > 1:
        pages = pages.reshape(-1, alloc.page_size)[:, 0] // alloc.page_size
    return pages.tolist()


def sglang_free_pages(alloc: Any, *, with_released: bool = False) -> list[int]:
    """SGLang's free list; its not yet merged ``release_pages`` must be empty, or with ``with_released`` follow."""
    if with_released:
        return torch.cat([alloc.free_pages, alloc.release_pages]).tolist()
    assert alloc.release_pages.numel() == 0, "SGLang holds released pages not yet merged"
    return alloc.free_pages.tolist()


def path_tokens(node: Any, root: Any, key_tokens: Callable[[Any], Iterable[Any]] = lambda k: k) -> tuple[int, ...]:
    """The tokens from ``root`` down to ``node``; ``key_tokens`` reads a node's key (SGLang's: ``.token_ids``)."""
    parts = []
    while node is not None and node is not root:
        parts.append(ids(key_tokens(node.key)))
        node = node.parent
    return tuple(t for p in reversed(parts) for t in p)


def tree_rows(root: Any, row: Callable[[Any], tuple]) -> list[tuple]:
    """Every node below ``root`` as ``row(node)``, in one canonical order (a tree's picture to compare)."""
    return sorted((row(n) for n in iter_subtree(root)), key=repr)


def lru_order(head: Any, tail: Any, prev: Callable[[Any], Any]) -> Iterator[Any]:
    """The nodes of one of SGLang's doubly linked LRU lists, most recent first."""
    x = prev(tail)
    while x is not head:
        yield x
        x = prev(x)


def window_prompts(rng: random.Random, page_size: int, window: int) -> list[list[int]]:
    """Prompt stems for the window caches: four random ones and one sharing half of the first."""
    bases = []
    for _ in range(4):
        n = rng.randrange(page_size, 4 * window + 4 * page_size + 4)
        bases.append([rng.randrange(4) for _ in range(n)])
    # Shared prefixes, so requests meet each other's paths.
    bases.append(bases[0][: len(bases[0]) // 2] + [rng.randrange(4) for _ in range(window + page_size)])
    return bases


class Clock:
    """A deterministic clock advanced once per top-level operation.

    kvcore reads ``clock()`` (one value per operation).  SGLang reads
    ``time.monotonic()`` several times inside one operation and with a real clock
    each later reading is (slightly) larger -- e.g. a new leaf is newer than the
    path it hangs from -- so its readings are ``t + k * 1e-6`` for the k-th call of
    the operation, and its times are compared after ``floor``.  Without that, SGLang
    breaks the resulting ties arbitrarily (heap order over a set of nodes).
    """

    def __init__(self) -> None:
        self.t = 1000.0
        self.k = 0

    def tick(self) -> None:
        self.t += 1.0
        self.k = 0

    def __call__(self) -> float:
        return self.t

    def sglang(self) -> float:
        self.k += 1
        return self.t + self.k * 1e-6

    def install(self, monkeypatch: Any, sglang_module: types.ModuleType) -> Clock:
        """Make ``sglang_module``'s ``time`` read :meth:`sglang` (pytest's ``monkeypatch`` undoes it)."""
        fake = types.SimpleNamespace(monotonic=self.sglang, time=self.sglang, perf_counter=time.perf_counter)
        monkeypatch.setattr(sglang_module, "time", fake)
        return self


class Harness:
    """One scenario run on both sides at once; subclasses add the two sides and the operations."""

    log_tail = 25  # operations shown in a mismatch report
    compare_after_op = False  # True: run() compares after every operation (else each operation does)

    def __init__(self, sg: Any, *, seed: Any, pair_size: int = 0):
        self.sg = sg
        self.seed = seed
        self.rng = random.Random(seed)
        self.log: list[str] = []
        self.op = -1  # index of the running operation (-1: setting up, n_ops: draining)
        self.pair = torch.full((pair_size,), -1, dtype=torch.int64)

    # ------------------------------------------------------------------ reporting

    def fail(self, what: str) -> None:
        tail = "\n  ".join(self.log[-self.log_tail:])
        raise Mismatch(f"seed={self.seed!r} op={self.op}: {what}\n  last ops:\n  {tail}")

    def eq(self, what: str, ours: Any, theirs: Any) -> None:
        if ours != theirs:
            self.fail(f"{what}: ours={ours!r} sglang={theirs!r}")

    def eq_rows(self, what: str, ours: list, theirs: list) -> None:
        """Two canonical row lists (a tree each, sorted) must be equal; a report shows only the rows that differ."""
        if ours != theirs:
            so, st = set(map(repr, ours)), set(map(repr, theirs))
            self.fail(f"{what} differ:\n    ours-only={sorted(so - st)}\n    sglang-only={sorted(st - so)}")

    # ------------------------------------------------------------------ slot pairing

    def pair_slots(self, ours: torch.Tensor, theirs: torch.Tensor) -> None:
        self.pair[ours.to(torch.int64)] = theirs.to(torch.int64)

    def mapped(self, slots: Any) -> list[int]:
        """SGLang's slots for ours, through the pairing."""
        return self.pair[torch.as_tensor(slots).to(torch.int64)].tolist()

    def place_slots(self, req: Any, sreq: Any, ours: torch.Tensor, theirs: torch.Tensor, start: int, end: int,
                    their_rows: torch.Tensor) -> None:
        """New slots for ``[start, end)`` of one request on both sides: paired, written into both rows, held."""
        self.pair_slots(ours, theirs)
        self.ours.req_to_token_pool.req_to_token[req.kv.req_pool_idx, start:end] = ours.to(torch.int32)
        their_rows[sreq.kv.req_pool_idx, start:end] = theirs.to(torch.int32)
        req.kv.kv_allocated_len = req.kv.kv_committed_len = end
        sreq.kv.kv_allocated_len = sreq.kv.kv_committed_len = end

    # ------------------------------------------------------------------ locks held by the test itself

    def hold(self, node: Any, their_node: Any) -> tuple[Any, Any]:
        """Lock a matched node on both sides and keep it in ``self.held``; (our lock, SGLang's lock result)."""
        lock = self.ours.inc_lock_ref(node)
        res = self.theirs.inc_lock_ref(their_node)
        self.held.append((node, lock, their_node, res))
        return lock, res

    def dec_params(self, res: Any) -> Any:
        """SGLang's ``DecLockRefParams`` that give back the lock ``res`` answered."""
        return self.sg.DecLockRefParams(swa_uuid_for_lock=res.swa_uuid_for_lock,
                                        skip_lock_node_ids=res.skip_lock_node_ids or {})

    def release_held(self, i: int) -> None:
        node, lock, their_node, res = self.held.pop(i)
        self.log.append(f"dec_lock_ref {self.opath(node)}")
        self.ours.dec_lock_ref(node, lock)
        self.theirs.dec_lock_ref(their_node, self.dec_params(res))
        self.compare("dec_lock_ref")

    def opath(self, node: Any) -> Any:
        """Our node's path, as the reports and canonical trees show it."""
        raise NotImplementedError

    # ------------------------------------------------------------------ the driver

    def compare(self, what: str) -> None:
        """Every size, pool and tree of the two sides must agree (a subclass says which)."""
        raise NotImplementedError

    def operation(self, *args: Any) -> None:
        """One random operation, drawn from ``self.rng``."""
        raise NotImplementedError

    def drain(self) -> None:
        """After the run: give everything back on both sides and check that it all came back."""

    def run(self, n_ops: int, *args: Any) -> Harness:
        try:
            for self.op in range(n_ops):
                self.operation(*args)
                if self.compare_after_op:
                    self.compare(f"op {self.op}")
            self.op = n_ops
            self.drain()
        except Mismatch:
            raise
        except Exception as exc:  # an error or assertion on either side, with the op log
            tail = "\n  ".join(self.log[-self.log_tail:])
            raise Mismatch(f"seed={self.seed!r} op={self.op}: {type(exc).__name__}: {exc}\n"
                           f"  last ops:\n  {tail}") from exc
        return self

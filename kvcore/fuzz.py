"""``kvcore fuzz``: a seeded random operation driver over :class:`kvcore.Engine`.

Every operation is drawn from one ``random.Random(seed)``, so a run is replayed
exactly by its seed and operation count.  Valid operations exercise the whole
engine protocol on a :class:`kvcore.StreamingSession` over the backend: admit
(shared prefixes, two tenants by ``extra_key``, session turns that continue or
diverge), chunked prefill, batched decode (with the window frees of windowed
backends), finish, retract, abort, session ends, eviction and hand-held locks.
Bad inputs are mixed in at ``bad_rate``: each must raise a clean error
(TypeError, ValueError, RuntimeError, LookupError) and change nothing, which a
snapshot of every pool, the row table and the cache sizes taken before it
proves.  The invariant checker runs every ``check_every`` operations and at the end.

A failure is reported as a :class:`FuzzFailure` (seed, page size, operation
number, what failed) with a one-line replay command.

``kvcore fuzz`` without ``--page-size`` runs twice, at the backend's own page size
and at :data:`FUZZ_PAGE_SIZE` (:func:`fuzz_page_sizes`), the operations split
between the two (:func:`split_ops`), so that a page-alignment bug shows without
making the run longer.  The options that tell a backend to accept bad input
(``strict=false``, ``disable=true``) are refused: the fuzz would blame the backend
for doing what it was told.
"""

from __future__ import annotations

import json
import random
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from pydantic import ValidationError

from kvcore.capabilities import windowed
from kvcore.engine import Engine
from kvcore.errors import InvariantViolation
from kvcore.factory import create_cache
from kvcore.invariants import InvariantChecker
from kvcore.keys import RadixKey
from kvcore.pools import SWATokenToKVPoolAllocator, TokenToKVPoolAllocator
from kvcore.record import Req
from kvcore.release import release_kv_cache
from kvcore.session import StreamingSession

__all__ = ["FUZZ_PAGE_SIZE", "FuzzFailure", "FuzzResult", "fuzz_config", "fuzz_page_sizes", "replay_command",
           "run_fuzz", "split_ops"]

CLEAN_ERRORS = (TypeError, ValueError, RuntimeError, LookupError)


class FuzzFailure(Exception):
    """A fuzz run found a bug: ``op`` is the 0-based operation number where it showed."""

    def __init__(self, backend: str, seed: int, op: int, what: str, replay: str, page_size: int | None = None):
        self.backend, self.seed, self.op, self.what, self.replay = backend, seed, op, what, replay
        self.page_size = page_size
        self.where = f"backend {backend}, seed {seed}, " + (
            f"page size {page_size}, " if page_size is not None else "") + f"operation {op}"
        super().__init__(f"fuzz failure: {self.where}: {what}\nreplay: {replay}")


@dataclass
class FuzzResult:
    backend: str
    seed: int
    ops: int
    seconds: float
    counts: dict[str, int] = field(default_factory=dict)
    checks: int = 0
    page_size: int = 1


# The second page size of a default run: a paged tree's alignment bugs show at any page > 1; 16 is SGLang's
# usual paged size and small enough for the fuzz's pools.
FUZZ_PAGE_SIZE = 16


def fuzz_page_sizes(backend: str, page_size: int | None = None) -> list[int]:
    """The page sizes a fuzz runs at: ``page_size`` when given, else the backend's own and FUZZ_PAGE_SIZE."""
    if page_size is not None:
        return [page_size]
    from kvcore.plugins import get_backend

    own = int(get_backend(backend).config.model_fields["page_size"].default or 1)
    return [own] if own == FUZZ_PAGE_SIZE else [own, FUZZ_PAGE_SIZE]


def split_ops(ops: int, parts: int) -> list[int]:
    """``ops`` operations shared by ``parts`` runs (the first ones take the remainder): the total stays ``ops``."""
    share, extra = divmod(ops, parts)
    return [share + (1 if i < extra else 0) for i in range(parts)]


def replay_command(backend: str, seed: int, op: int, page_size: int | None, bad_rate: float,
                   backend_options: dict[str, Any] | None = None) -> str:
    cmd = f"kvcore fuzz --backend {backend} --ops {op + 1} --seed {seed} --check-every 1"
    if page_size is not None:
        cmd += f" --page-size {page_size}"
    if bad_rate != 0.05:
        cmd += f" --bad-rate {bad_rate}"
    for key, value in (backend_options or {}).items():
        text = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))
        cmd += f" --backend-opt {shlex.quote(f'{key}={text}')}"
    return cmd


# The fuzz sizes these itself (small pools); --page-size is the one a user chooses.
FUZZ_MANAGED = {"size": None, "page_size": "--page-size", "max_num_reqs": None, "max_context_len": None,
                "sliding_window_size": None, "swa_size": None}

# Options that tell a backend to accept what the fuzz feeds it as bad input: with them a clean refusal is
# no longer the backend's promise, so the fuzz would report the backend for keeping its word.
FUZZ_REFUSED = {
    "strict": (False, "strict=false tells the backend to skip the slot checks that refuse bad inserts"),
    "disable": (True, "disable=true tells the tree to take no insert, so it never looks at a bad one's slots"),
}


def fuzz_config(backend: str, page_size: int | None, backend_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Small pools (so that eviction, retraction and session releases happen often) the backend accepts.

    Tries 96 pages, then larger pools, for backends whose own options need more room.
    ``backend_options`` (``--backend-opt``) go in as they are; the backend's config model
    validates them, and an error names the option the user gave.
    """
    from kvcore.backend_options import OptionError, format_validation_error
    from kvcore.factory import ConfigError
    from kvcore.plugins import get_backend

    model = get_backend(backend).config
    fields = model.model_fields
    extra = dict(backend_options or {})
    for key, (value, why) in FUZZ_REFUSED.items():
        if key in extra and extra[key] is value:
            raise OptionError(f"--backend-opt {key}={json.dumps(value)}: the fuzz checks that bad input is refused "
                              f"and {why}; fuzz without it")
    for key in extra:
        if key in FUZZ_MANAGED:
            flag = FUZZ_MANAGED[key]
            raise OptionError(f"--backend-opt {key}: the fuzz sizes {key} itself" + (f"; use {flag}" if flag else ""))
    ps = page_size if page_size is not None else int(fields["page_size"].default or 1)
    flags = {"page_size": "--page-size", **{k: f"--backend-opt {k}" for k in extra}}
    given = ([f"--page-size {page_size}"] if page_size is not None else []) + [
        f"--backend-opt {k}={v}" for k, v in extra.items()]
    what = f"backend {backend!r}" + (f" with {' '.join(given)}" if given else "")
    error = ""
    # Fine steps: at page 16 a backend that needs a fixed number of slots (hisparse: its device buffer)
    # gets the pool it needs, not one 16 times larger, whose free lists every snapshot and check reads.
    for scale in (1, 4, 16, 64, 256, 1024):
        kwargs: dict[str, Any] = {
            "size": 96 * ps * scale, "page_size": ps, "max_num_reqs": 6, "max_context_len": 16 * ps,
        }
        if "sliding_window_size" in fields:
            kwargs["sliding_window_size"] = 2 * ps
        if "swa_size" in fields:
            kwargs["swa_size"] = 64 * ps * scale
        kwargs.update(extra)
        try:
            model(**kwargs)
        except ValidationError as exc:
            error = format_validation_error(exc, flags, known=fields)
            if any(str(e["loc"][0]) in flags for e in exc.errors() if e["loc"]):
                # The user's own option is refused: a larger pool will not help.
                raise ConfigError(f"{what}: {error}") from None
            continue
        except (ConfigError, ValueError) as exc:
            error = str(exc)
            continue
        return kwargs
    raise ConfigError(f"{what}: no small configuration for the fuzz validates: {error}")


def _as_bytes(slots: torch.Tensor) -> tuple[str, bytes]:
    """A slot list as comparable bytes: a pool the fuzz had to make large (a backend that needs room at
    page 16) holds 10^5 free slots, which ``tolist`` turns into as many Python ints per snapshot."""
    return str(slots.dtype), slots.detach().cpu().contiguous().numpy().tobytes()


class _Driver:
    def __init__(self, backend: str, seed: int, page_size: int | None, bad_rate: float,
                 backend_options: dict[str, Any] | None = None):
        self.backend = backend
        self.backend_options = dict(backend_options or {})
        self.rng = random.Random(seed)
        kwargs = fuzz_config(backend, page_size, self.backend_options)
        self.ps = kwargs["page_size"]
        self.width = kwargs["max_context_len"]
        self.inner = create_cache(backend, **kwargs)
        self.row_windowed = any(v.windowed and v.translate is None for v in self.inner.pools())
        self.cache = StreamingSession(self.inner)
        self.engine = Engine(self.cache)
        self.alloc = self.inner.token_to_kv_pool_allocator
        self.bad_rate = bad_rate
        self.is_chunk = self.inner.is_chunk_cache()
        rng = self.rng
        # Few short prompts over a small vocabulary: prefixes are shared and split often.
        self.bases = [[rng.randrange(1, 9) for _ in range(self.width)] for _ in range(4)]
        self.prefill: list[Req] = []  # admitted, prompt not all computed
        self.decoding: list[Req] = []
        self.waiting: list[Req] = []  # retracted: admitted again later
        self.locks: list[tuple[Any, Any]] = []  # hand-held (node, lock) on the inner cache
        self.session_tokens: dict[str, list[int]] = {}  # sid -> tokens of its last finished turn
        self.busy_sessions: set[str] = set()
        self.session_extra: dict[str, str | None] = {}
        self._other: Any = None  # another cache, for releases on the wrong one
        # What each full slot's K/V was computed from: a hash of (extra_key, tokens up to its position).
        # A matched or reused prefix must hold exactly the request's own chain.
        self.shadow: dict[int, int] = {}
        self.n = 0
        self.counts: dict[str, int] = {}

    # ------------------------------------------------------------- helpers
    def owners(self) -> list[Req]:
        return self.prefill + self.decoding

    def snapshot(self) -> tuple:
        pools = []
        for pool in self.cache.pools():
            pools.append((pool.name, pool.available(), _as_bytes(pool.allocator.free_slots())))
        r2t = self.inner.req_to_token_pool
        alloc = self.alloc
        claimed = (
            _as_bytes(alloc.claimed_slots())
            if isinstance(alloc, (TokenToKVPoolAllocator, SWATokenToKVPoolAllocator))
            else None
        )
        records = [
            (r.rid, r.kv.req_pool_idx, r.kv.cache_protected_len, r.kv.kv_committed_len, r.kv.kv_allocated_len,
             r.kv.swa_evicted_seqlen, len(r.output_ids))
            for r in self.owners()
        ]
        return (
            pools,
            sorted(r2t.free_rows()),
            self.inner.cached_sizes(),
            self.inner.total_size(),
            claimed,
            sorted(self.cache.slots),
            records,
        )

    def _prompt(self) -> list[int]:
        rng = self.rng
        base = rng.choice(self.bases)
        cut = rng.randrange(0, self.width // 2)
        tail = [rng.randrange(1, 9) for _ in range(rng.randrange(1, self.width // 3))]
        return base[:cut] + tail

    def _new_req(self) -> Req:
        rng = self.rng
        self.n += 1
        extra = rng.choice([None, None, "tenant-b"])
        sid = None
        ids = self._prompt()
        if rng.random() < 0.3:
            sid = f"s{rng.randrange(3)}"
            if sid in self.busy_sessions:
                sid = None
            elif sid in self.session_tokens and self.engine.session_is_live(sid):
                prev = self.session_tokens[sid]
                if rng.random() < 0.8:
                    ids = prev + [rng.randrange(1, 9) for _ in range(rng.randrange(1, 6))]
                else:  # a turn that rewrites the conversation: only the common prefix may be reused
                    ids = prev[: rng.randrange(len(prev) + 1)] + [rng.randrange(9, 12) for _ in range(3)]
                extra = self.session_extra.get(sid)
        ids = ids[: self.width - 8]
        req = Req(f"r{self.n}", ids, extra_key=extra, session_id=sid)
        return req

    @staticmethod
    def _chain(req: Req, hi: int) -> list[int]:
        h = hash(("kvcore-fuzz", req.extra_key))
        out = []
        for t in req.fill_ids[:hi]:
            h = hash((h, t))
            out.append(h)
        return out

    def _row(self, req: Req, lo: int, hi: int) -> list[int]:
        return self.inner.req_to_token_pool.req_to_token[req.kv.req_pool_idx, lo:hi].tolist()

    def _record(self, req: Req, lo: int, hi: int) -> None:
        """The engine computed positions [lo, hi) of req's row: remember what each slot holds."""
        if hi > lo:
            chain = self._chain(req, hi)
            for pos, slot in zip(range(lo, hi), self._row(req, lo, hi)):
                self.shadow[slot] = chain[pos]

    def _verify(self, req: Req, hi: int, when: str) -> None:
        """Positions [0, hi) of req's row must hold K/V computed from req's own tokens."""
        if hi <= 0:
            return
        chain = self._chain(req, hi)
        # Where the row's own pool is windowed (pure SWA), the window free gave the slots of
        # [swa_dead_lo, swa_evicted_seqlen) back: the row keeps stale ids there, no K/V.
        dead_lo = req.kv.swa_dead_lo(self.inner.page_size) if self.row_windowed else 0
        dead_hi = req.kv.swa_evicted_seqlen if self.row_windowed else 0
        for pos, slot in enumerate(self._row(req, 0, hi)):
            if dead_lo <= pos < dead_hi:
                continue
            if self.shadow.get(slot) != chain[pos]:
                raise AssertionError(
                    f"{when}: request {req.rid!r} position {pos} (slot {slot}) holds K/V of other tokens "
                    f"(a prefix was reused for tokens that differ)"
                )

    def _done(self, req: Req) -> None:
        if req.session_id is not None:
            self.busy_sessions.discard(req.session_id)

    # ------------------------------------------------------------- valid operations
    def op_admit(self) -> None:
        req = self.waiting.pop(0) if self.waiting and self.rng.random() < 0.5 else self._new_req()
        sid = req.session_id
        if sid is not None and sid in self.busy_sessions:
            return
        try:
            ok = self.engine.admit(req)
        except ValueError as exc:
            # A session turn that diverges inside the tree's part is refused: end the session, try again.
            if sid is None or "session" not in str(exc):
                raise
            self.engine.end_session(sid)
            ok = self.engine.admit(req)
        if not ok:
            return
        self._verify(req, req.kv.kv_allocated_len, "admit")
        if sid is not None:
            self.busy_sessions.add(sid)
            self.session_extra[sid] = req.extra_key
        if req.kv.kv_allocated_len >= req.seqlen:
            self.decoding.append(req)
        else:
            self.prefill.append(req)

    def op_extend(self) -> None:
        if not self.prefill:
            return
        req = self.rng.choice(self.prefill)
        kv = req.kv
        start = kv.kv_allocated_len
        end = start + self.rng.randrange(1, 3 * self.ps + 2)
        if not self.engine.extend(req, end):
            self._retract(req)
            return
        self._record(req, start, kv.kv_allocated_len)
        self._verify(req, kv.kv_committed_len, "extend")
        if kv.kv_committed_len >= req.seqlen:
            self.prefill.remove(req)
            self.decoding.append(req)

    def op_decode(self) -> None:
        if not self.decoding:
            return
        batch = [r for r in self.decoding if r.kv.kv_allocated_len < self.width - 1]
        for r in self.decoding:
            if r not in batch:
                self._finish(r)
        if not batch:
            return
        batch = self.rng.sample(batch, min(len(batch), self.rng.randrange(1, 4)))
        if not self.engine.decode(batch, [self.rng.randrange(1, 9) for _ in batch]):
            self._retract(batch[-1])
            return
        for r in batch:
            self._record(r, r.kv.kv_allocated_len - 1, r.kv.kv_allocated_len)

    def _finish(self, req: Req) -> None:
        self._verify(req, req.kv.kv_committed_len, "finish")
        self.engine.finish(req)
        (self.decoding if req in self.decoding else self.prefill).remove(req)
        if req.session_id is not None and self.engine.session_is_live(req.session_id):
            self.session_tokens[req.session_id] = req.fill_ids[: self.cache.slots[req.session_id].kv.kv_committed_len]
        self._done(req)

    def op_finish(self) -> None:
        if self.decoding:
            self._finish(self.rng.choice(self.decoding))

    def _retract(self, req: Req) -> None:
        self.engine.retract(req)
        (self.decoding if req in self.decoding else self.prefill).remove(req)
        self._done(req)
        if req.session_id is not None:
            self.session_tokens.pop(req.session_id, None)
        req.output_ids.clear()
        req.session_id = None
        if len(self.waiting) < 8:
            self.waiting.append(req)

    def op_retract(self) -> None:
        live = self.owners()
        if live:
            self._retract(self.rng.choice(live))

    def op_abort(self) -> None:
        live = self.owners()
        if not live:
            return
        req = self.rng.choice(live)
        self.engine.abort(req)
        (self.decoding if req in self.decoding else self.prefill).remove(req)
        self._done(req)
        if req.session_id is not None:
            self.session_tokens.pop(req.session_id, None)

    def op_end_session(self) -> None:
        idle = [s for s in self.cache.slots if s not in self.busy_sessions]
        if idle:
            sid = self.rng.choice(idle)
            self.engine.end_session(sid)
            self.session_tokens.pop(sid, None)

    def op_evict(self) -> None:
        self.inner.evict(self.rng.randrange(0, 8 * self.ps))

    def op_lock(self) -> None:
        if self.locks and (self.rng.random() < 0.5 or len(self.locks) > 3):
            node, lock = self.locks.pop(self.rng.randrange(len(self.locks)))
            self.inner.dec_lock_ref(node, lock)
            return
        key = RadixKey(self._prompt(), self.rng.choice([None, "tenant-b"]))
        m = self.inner.match_prefix(key)
        self.locks.append((m.last_device_node, self.inner.inc_lock_ref(m.last_device_node)))

    # ------------------------------------------------------------- bad inputs
    def _tree_slots(self) -> torch.Tensor | None:
        owned = [so.slots for so in self.inner.iter_owned_slots() if so.pool == "full" and so.slots.numel()]
        return torch.cat(owned) if owned else None

    def bad_ops(self) -> list[tuple[str, Callable[[], Any], bool]]:
        """(name, call, must_raise): must_raise is False where a no-op is a correct answer."""
        ps, inner, alloc, rng = self.ps, self.inner, self.alloc, self.rng
        key = [rng.randrange(20, 30) for _ in range(ps)]
        tree = not self.is_chunk

        def insert_with(slots: torch.Tensor) -> Callable[[], Any]:
            return lambda: inner.insert(RadixKey(key), slots)

        full = next(p for p in self.cache.pools() if p.name == "full")
        free = full.allocator.free_slots()
        ops: list[tuple[str, Callable[[], Any], bool]] = [
            ("insert padding slot", insert_with(torch.zeros(ps, dtype=torch.int64)), tree),
            ("insert out-of-range slot", insert_with(torch.full((ps,), 10**9, dtype=torch.int64)), tree),
            ("insert negative slot", insert_with(torch.full((ps,), -3, dtype=torch.int64)), tree),
            ("insert float value", insert_with(torch.zeros(ps, dtype=torch.float32)), tree),
            ("match bool key", lambda: inner.match_prefix([True, False] * ps), True),
            ("match negative token", lambda: inner.match_prefix([1, -1]), True),
            # Deliberately ill-typed: the bad inputs a caller may pass.
            ("match float token", lambda: inner.match_prefix([1.5]), True),  # type: ignore[list-item]
            ("evict -1", lambda: inner.evict(-1), True),
            ("evict str", lambda: inner.evict("x"), True),  # type: ignore[arg-type]
            ("alloc str", lambda: alloc.alloc("4"), True),  # type: ignore[arg-type]
            ("alloc negative", lambda: alloc.alloc(-ps), True),
            ("free padding", lambda: alloc.free(torch.zeros(1, dtype=torch.int64)), True),
            ("dec_lock_ref foreign node", lambda: inner.dec_lock_ref(object()), tree),
            ("decode with no KV", lambda: self.engine.decode([Req("ghost", [1, 2])]), True),
            ("finish a request holding nothing", lambda: inner.cache_finished_req(Req("ghost", [1, 2, 3])), True),
            ("retract a request that is not running", lambda: self.engine.retract(Req("ghost", [1, 2])), True),
            ("admit an empty prompt", lambda: self.engine.admit(Req("ghost", [])), True),
            ("admit a token id past int64", lambda: self.engine.admit(Req("ghost", [1, 1 << 63])), True),
        ]
        if free.numel() >= ps and tree:
            # prev_prefix_len must never narrow the slot check (backends without it refuse the argument).
            ops.append(("insert free slots under prev_prefix_len",
                        lambda: inner.insert(RadixKey(key), free[:ps].clone(),
                                             prev_prefix_len=ps),  # type: ignore[call-arg]
                        True))
        if free.numel() >= ps:
            ops.append(("insert free slots", insert_with(free[:ps].clone()), tree))
            ops.append(("double free", lambda: alloc.free(free[:1].clone()), True))
        owned = self._tree_slots()
        if owned is not None and owned.numel() >= ps:
            ops.append(("insert slots another node owns", insert_with(owned[:ps].clone()), tree))
        live = self.owners()
        if live:
            req = rng.choice(live)
            row = req.kv
            n = row.kv_allocated_len - row.cache_protected_len
            if n >= 1 and ps == 1:
                s = int(self.inner.req_to_token_pool.req_to_token[row.req_pool_idx, row.kv_allocated_len - 1])
                dup = torch.tensor([s, s], dtype=torch.int64)
                ops.append(("insert duplicated slots", lambda: inner.insert(RadixKey([27, 28]), dup), tree))
            if self._other is None:
                self._other = create_cache(self.backend, **fuzz_config(self.backend, ps, self.backend_options))
            other = self._other
            ops.append(("release on another cache", lambda: release_kv_cache(req, other), True))
            ops.append(("cache_unfinished_req on another cache", lambda: other.cache_unfinished_req(req), True))
            ops.append(("corrupted committed length", self._corrupted(req, "kv_committed_len", row.kv_allocated_len + 1,
                                                                      lambda: self.engine.finish(req)), True))
            win, other_win = windowed(self.cache), windowed(other)
            if win is not None and other_win is not None:
                ops.append(("window cursor past committed",
                            self._corrupted(req, "swa_evicted_seqlen", row.kv_committed_len + 4 * ps,
                                            lambda: win.free_window_slots([req])), True))
                ops.append(("float window floor", self._corrupted(req, "swa_evict_floor", 2.5,
                                                                  lambda: win.free_window_slots([req])), True))
                ops.append(("pre_lens longer than the batch", lambda: win.free_window_slots([req], [1, 2]), True))
                ops.append(("window free on another cache", lambda: other_win.free_window_slots([req]), True))
            if req in self.decoding:
                ops.append(("decode batch naming a request twice", lambda: self.engine.decode([req, req]), True))
            busy = [r.session_id for r in live if r.session_id is not None and r.session_id in self.cache.slots
                    and r.kv is self.cache.slots[r.session_id].kv]
            if busy:
                ops.append(("release_session under a running turn", lambda: self.cache.release_session(busy[0]),
                            True))
        return ops

    @staticmethod
    def _corrupted(req: Req, field: str, value: Any, call: Callable[[], Any]) -> Callable[[], Any]:
        """``call`` with one of ``req``'s record fields corrupted, restored afterwards however it ends."""
        def run() -> Any:
            kv = req.kv
            saved = getattr(kv, field)
            setattr(kv, field, value)
            try:
                return call()
            finally:
                setattr(kv, field, saved)
        return run

    def op_bad(self, op_no: int) -> str:
        name, call, must_raise = self.rng.choice(self.bad_ops())
        before = self.snapshot()
        raised = False
        try:
            call()
        except CLEAN_ERRORS:
            raised = True
        except Exception as exc:  # an unclean error type is a bug too
            raise AssertionError(f"bad input {name!r} raised {type(exc).__name__}: {exc}") from exc
        if must_raise and not raised:
            raise AssertionError(f"bad input {name!r} was accepted")
        after = self.snapshot()
        if after != before:
            diff = [i for i, (a, b) in enumerate(zip(before, after)) if a != b]
            raise AssertionError(f"bad input {name!r} changed the state (snapshot parts {diff})")
        return name

    # ------------------------------------------------------------- teardown
    def drain(self) -> None:
        for req in list(self.owners()):
            if self.rng.random() < 0.5:
                self.engine.finish(req)
            else:
                self.engine.abort(req)
            self._done(req)
        self.prefill.clear()
        self.decoding.clear()
        for node, lock in self.locks:
            self.inner.dec_lock_ref(node, lock)
        self.locks.clear()
        for sid in list(self.cache.slots):
            self.engine.end_session(sid)
        self.check()
        if self.inner.protected_size():
            raise AssertionError(f"{self.inner.protected_size()} tokens still locked after every lock was given back")

    def check(self) -> None:
        InvariantChecker(self.cache).check(self.owners())


_OPS = [
    ("admit", 0.20),
    ("extend", 0.22),
    ("decode", 0.25),
    ("finish", 0.08),
    ("retract", 0.03),
    ("abort", 0.03),
    ("end_session", 0.03),
    ("evict", 0.06),
    ("lock", 0.10),
]


def run_fuzz(
    backend: str,
    ops: int,
    seed: int = 0,
    *,
    check_every: int = 100,
    bad_rate: float = 0.05,
    page_size: int | None = None,
    backend_options: dict[str, Any] | None = None,
    progress: Callable[[int], None] | None = None,
) -> FuzzResult:
    """Run ``ops`` seeded random operations on ``backend`` at one page size (``page_size``, default the
    backend's); raises FuzzFailure on the first bug."""
    if ops < 0 or check_every < 1 or not 0.0 <= bad_rate <= 1.0:
        raise ValueError(f"need ops >= 0, check_every >= 1 and 0 <= bad_rate <= 1 (got {ops}, {check_every}, "
                         f"{bad_rate})")
    d = _Driver(backend, seed, page_size, bad_rate, backend_options)
    names = [n for n, _ in _OPS]
    weights = [w for _, w in _OPS]
    rng = d.rng
    counts: dict[str, int] = {}
    checks = 0
    step = max(10_000, ops // 10)  # progress: every tenth of the run, at most every 10,000 operations
    t0 = time.perf_counter()
    i = 0
    try:
        for i in range(ops):
            if rng.random() < bad_rate:
                name = "bad: " + d.op_bad(i)
            else:
                name = rng.choices(names, weights)[0]
                getattr(d, "op_" + name)()
            counts[name] = counts.get(name, 0) + 1
            if (i + 1) % check_every == 0:
                d.check()
                checks += 1
            if progress is not None and (i + 1) % step == 0:
                progress(i + 1)
        i = ops
        d.drain()
        checks += 1
    except (AssertionError, InvariantViolation, *CLEAN_ERRORS) as exc:
        what = f"{type(exc).__name__}: {exc}"
        # The replay names the page size: without --page-size the command would run at two.
        replay = replay_command(backend, seed, i, d.ps, bad_rate, backend_options)
        raise FuzzFailure(backend, seed, i, what, replay, d.ps) from exc
    return FuzzResult(backend, seed, ops, time.perf_counter() - t0, counts, checks, d.ps)

"""The conformance suite every KV store runs (see :mod:`kvcore.stores`).

A store author subclasses :class:`StoreConformance` in a pytest module and names
the URL; the kit opens it with ``kvcore.open_store``::

    from kvcore.testing.stores import StoreConformance


    class TestMyStore(StoreConformance):
        store_url = "mystore://127.0.0.1:7000"

What the kit cannot do through the interface, the subclass declares and supplies:
``corrupt(store, key, data)`` puts raw bytes under a key (default: through
``store.corrupt``); ``can_go_away`` with ``break_store(store)`` /
``restore_store(store)`` (stop and start the server, make the directory
unusable) enables the test of a store that goes away mid-run; ``supports_ttl``
enables the TTL test.  A ``store_url`` fixture override can build the URL at run
time (a server on a free port).

Scenarios: round trips of several sizes, contiguous ``batch_exists``, misses,
overwrite, truncated / foreign / garbage values read as misses, bad arguments
refused before anything is sent, a store that goes away mid-run (misses and
``False``, counted in ``errors``, never an exception; works again once back),
concurrent writers of one key (a reader sees one whole value), ``clear``,
``ttl``, ``stats`` counters, and namespaced keys; and the same promises for
``batch_get_views`` and ``batch_get_into`` (a value of another size than the
buffer, or one that fails its check, is ``False``, counted in ``errors``).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

import pytest

from kvcore.stores import FRAME_OVERHEAD, KVStore, StoreNamespace, frame, open_store

if TYPE_CHECKING:
    import torch

    from kvcore.cache import BasePrefixCache
    from kvcore.record import Req

__all__ = ["StoreConformance", "with_options"]

STATS_KEYS = {"hits", "misses", "errors", "bytes_read", "bytes_written", "round_trips"}


def with_options(url: str, **options: object) -> str:
    """``url`` with ``options`` appended to its query."""
    if not options:
        return url
    sep = "&" if "?" in url else "?"
    return url + sep + "&".join(f"{k}={v}" for k, v in options.items())


def _eventually(check: Callable[[], object], what: str, deadline_s: float = 15.0) -> None:
    """Poll ``check()`` (a bounded loop: a store may take a moment to reconnect or expire a key)."""
    end = time.monotonic() + deadline_s
    while not check():
        if time.monotonic() > end:
            raise AssertionError(f"{what} did not happen within {deadline_s}s")
        time.sleep(0.05)


class StoreConformance:
    """Subclass with ``store_url`` (or a ``store_url`` fixture) to run the store kit."""

    store_url: str = ""
    can_go_away: bool = False
    supports_ttl: bool = True
    # Each test writes under its own key prefix, so a shared server needs no flush between tests.
    _run = f"{os.getpid()}-{time.monotonic_ns()}"

    # -- what a subclass supplies -------------------------------------------

    def corrupt(self, store: KVStore, key: str, data: bytes) -> None:
        """Put ``data`` under ``key`` as raw bytes, with no frame."""
        store.corrupt(key, data)  # type: ignore[attr-defined]

    def break_store(self, store: KVStore) -> None:
        """Make the store unreachable (stop the server, make the directory unusable)."""
        raise NotImplementedError

    def restore_store(self, store: KVStore) -> None:
        """Undo ``break_store``."""
        raise NotImplementedError

    # -- fixtures ---------------------------------------------------------------

    def open(self, url: str, **options: object) -> KVStore:
        return open_store(with_options(url, **options))

    @pytest.fixture
    def store(self, store_url: str) -> Iterator[KVStore]:
        s = self.open(store_url)
        yield s
        s.close()

    @pytest.fixture(name="store_url")
    def _store_url(self) -> str:
        assert self.store_url, f"{type(self).__name__} sets store_url or overrides the store_url fixture"
        return self.store_url

    @pytest.fixture
    def keys(self, request: pytest.FixtureRequest) -> list[str]:
        return [f"kvcore-kit:{self._run}:{request.node.name}:{i}" for i in range(8)]

    # -- scenarios ---------------------------------------------------------------

    def test_round_trip(self, store: KVStore, keys: list[str]) -> None:
        values = [os.urandom(n) for n in (0, 1, 100, 4096, 1 << 17)]
        before = store.stats()
        assert store.batch_set(keys[:5], values) == [True] * 5
        assert store.batch_get(keys[:5]) == values
        after = store.stats()
        assert set(after) == STATS_KEYS
        assert after["hits"] - before["hits"] == 5
        assert after["bytes_read"] - before["bytes_read"] == sum(map(len, values))
        assert after["bytes_written"] - before["bytes_written"] == sum(map(len, values))
        assert after["round_trips"] - before["round_trips"] >= 2
        assert after["errors"] == before["errors"]

    def test_batch_exists_is_contiguous(self, store: KVStore, keys: list[str]) -> None:
        store.batch_set([keys[0], keys[1], keys[3]], [b"a", b"b", b"d"])
        assert store.batch_exists(keys[:4]) == 2
        assert store.batch_exists([keys[2], keys[0]]) == 0
        assert store.batch_exists(keys[:2]) == 2
        assert store.batch_exists([]) == 0

    def test_misses(self, store: KVStore, keys: list[str]) -> None:
        before = store.stats()
        assert store.batch_get(keys[:3]) == [None, None, None]
        store.batch_set([keys[1]], [b"x"])
        assert store.batch_get(keys[:3]) == [None, b"x", None]
        after = store.stats()
        assert after["misses"] - before["misses"] == 5
        assert after["hits"] - before["hits"] == 1
        assert after["errors"] == before["errors"]

    def test_overwrite(self, store: KVStore, keys: list[str]) -> None:
        store.batch_set([keys[0]], [b"first"])
        store.batch_set([keys[0]], [b"second value"])
        assert store.batch_get([keys[0]]) == [b"second value"]

    def test_corrupted_truncated_and_foreign_values_are_misses(self, store: KVStore, keys: list[str]) -> None:
        payload = os.urandom(1000)
        store.batch_set(keys[:4], [payload] * 4)
        good = frame(keys[0], payload)
        self.corrupt(store, keys[0], b"garbage that is no frame at all")
        self.corrupt(store, keys[1], good[: FRAME_OVERHEAD + 500])  # truncated
        self.corrupt(store, keys[2], frame("another namespace:page", payload))  # foreign
        flipped = bytearray(frame(keys[3], payload))
        flipped[-1] ^= 0xFF
        self.corrupt(store, keys[3], bytes(flipped))  # one bit pattern changed
        before = store.stats()
        assert store.batch_get(keys[:4]) == [None] * 4
        after = store.stats()
        assert after["misses"] - before["misses"] == 4
        assert after["errors"] - before["errors"] == 4

    def test_bad_arguments_raise_and_send_nothing(self, store: KVStore, keys: list[str]) -> None:
        before = store.stats()
        with pytest.raises(ValueError, match="values"):
            store.batch_set(keys[:2], [b"x"])
        with pytest.raises(ValueError, match="keys"):
            store.batch_get([keys[0], 7])  # type: ignore[list-item]
        with pytest.raises(ValueError, match="bytes"):
            store.batch_set([keys[0]], ["text"])  # type: ignore[list-item]
        assert store.stats() == before
        assert store.batch_get([keys[0]]) == [None]

    def test_store_that_goes_away_mid_run(self, store: KVStore, keys: list[str]) -> None:
        if not self.can_go_away:
            pytest.skip(f"{type(self).__name__} declares can_go_away = False (an in-process store cannot go away)")
        store.batch_set(keys[:2], [b"a", b"b"])
        self.break_store(store)
        try:
            errors = store.stats()["errors"]
            assert store.batch_get(keys[:2]) == [None, None]
            assert store.batch_set(keys[2:4], [b"c", b"d"]) == [False, False]
            assert store.batch_exists(keys[:2]) == 0
            assert store.stats()["errors"] > errors
        finally:
            self.restore_store(store)
        _eventually(lambda: store.batch_set([keys[4]], [b"e"]) == [True], "a write after the store came back")
        assert store.batch_get([keys[4]]) == [b"e"]

    def test_concurrent_writers_of_one_key(self, store: KVStore, keys: list[str]) -> None:
        values = [bytes([i]) * (2000 + i) for i in range(6)]
        seen: list[bytes | None] = []
        failures: list[BaseException] = []

        def writer(v: bytes) -> None:
            try:
                for _ in range(15):
                    store.batch_set([keys[0]], [v])
                    seen.append(store.batch_get([keys[0]])[0])
            except BaseException as exc:  # surfaced below: a thread's exception would otherwise vanish
                failures.append(exc)

        threads = [threading.Thread(target=writer, args=(v,)) for v in values]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not failures
        assert all(s in values for s in seen)  # always one whole value, never a mix
        assert store.batch_get([keys[0]])[0] in values

    def test_clear(self, store: KVStore, keys: list[str]) -> None:
        store.batch_set(keys[:2], [b"a", b"b"])
        assert store.clear() is True
        assert store.batch_get(keys[:2]) == [None, None]

    def test_ttl(self, store_url: str, keys: list[str]) -> None:
        if not self.supports_ttl:
            pytest.skip(f"{type(self).__name__} declares supports_ttl = False")
        store = self.open(store_url, ttl=1)
        try:
            assert store.batch_set([keys[0]], [b"short-lived"]) == [True]
            _eventually(lambda: store.batch_get([keys[0]]) == [None], "expiry after ttl=1")
        finally:
            store.close()

    def test_closed_store_answers_misses(self, store_url: str, keys: list[str]) -> None:
        store = self.open(store_url)
        store.close()
        assert store.batch_get([keys[0]]) == [None]
        assert store.batch_set([keys[0]], [b"x"]) == [False]
        assert store.batch_exists([keys[0]]) == 0

    def test_views_and_into_round_trip(self, store: KVStore, keys: list[str]) -> None:
        values = [os.urandom(n) for n in (0, 1, 100, 4096, 1 << 17)]
        store.batch_set(keys[:5], values)
        before = store.stats()
        views = store.batch_get_views(keys[:6])
        assert [None if v is None else bytes(v) for v in views] == [*values, None]
        assert all(v is None or v.readonly for v in views)
        buffers = [bytearray(len(v)) for v in values] + [bytearray(8)]
        assert store.batch_get_into(keys[:6], buffers) == [True] * 5 + [False]
        assert buffers[:5] == values
        after = store.stats()
        assert after["hits"] - before["hits"] == 10 and after["misses"] - before["misses"] == 2
        assert after["bytes_read"] - before["bytes_read"] == 2 * sum(map(len, values))
        assert after["errors"] == before["errors"]
        assert store.batch_get_views([]) == [] and store.batch_get_into([], []) == []

    def test_into_a_buffer_of_another_size_or_a_bad_value_is_false(self, store: KVStore, keys: list[str]) -> None:
        payload = os.urandom(3000)
        store.batch_set(keys[:4], [payload] * 4)
        self.corrupt(store, keys[2], frame(keys[2], payload)[: FRAME_OVERHEAD + 2000])  # truncated
        flipped = bytearray(frame(keys[3], payload))
        flipped[FRAME_OVERHEAD + 7] ^= 0x01
        self.corrupt(store, keys[3], bytes(flipped))
        before = store.stats()
        # A stale buffer that already holds the payload must not pass for a truncated value.
        buffers = [bytearray(2999), bytearray(3001), bytearray(payload), bytearray(3000)]
        assert store.batch_get_into(keys[:4], buffers) == [False] * 4
        assert store.batch_get_views(keys[2:4]) == [None, None]
        after = store.stats()
        assert after["errors"] - before["errors"] == 6 and after["misses"] - before["misses"] == 6
        assert after["hits"] == before["hits"]

    def test_into_takes_any_writable_contiguous_buffer(self, store: KVStore, keys: list[str]) -> None:
        import numpy as np

        payload = os.urandom(4 * 64)
        store.batch_set(keys[:3], [payload] * 3)
        floats = np.zeros((4, 16), dtype=np.float32)
        block = bytearray(3 * len(payload))
        view = memoryview(block)[len(payload): 2 * len(payload)]
        assert store.batch_get_into(keys[:3], [floats, view, memoryview(bytearray(len(payload)))]) == [True] * 3
        assert floats.tobytes() == payload and bytes(view) == payload
        assert block[: len(payload)] == bytes(len(payload)) and block[2 * len(payload):] == bytes(len(payload))

    def test_into_refuses_bad_buffers_and_sends_nothing(self, store: KVStore, keys: list[str]) -> None:
        import numpy as np

        before = store.stats()
        with pytest.raises(ValueError, match="2 keys but 1 buffers"):
            store.batch_get_into(keys[:2], [bytearray(4)])
        with pytest.raises(ValueError, match=r"buffers\[0\] is read-only"):
            store.batch_get_into(keys[:1], [b"1234"])
        with pytest.raises(ValueError, match=r"buffers\[1\] is a str, not a buffer"):
            store.batch_get_into(keys[:2], [bytearray(4), "text"])  # type: ignore[list-item]
        with pytest.raises(ValueError, match="not contiguous"):
            store.batch_get_into(keys[:1], [np.zeros((4, 4), dtype=np.uint8)[:, 1]])
        with pytest.raises(ValueError, match="keys"):
            store.batch_get_views([keys[0], 7])  # type: ignore[list-item]
        assert store.stats() == before

    def test_views_and_into_when_the_store_goes_away(self, store: KVStore, keys: list[str]) -> None:
        if not self.can_go_away:
            pytest.skip(f"{type(self).__name__} declares can_go_away = False (an in-process store cannot go away)")
        store.batch_set(keys[:2], [b"a", b"b"])
        self.break_store(store)
        try:
            errors = store.stats()["errors"]
            assert store.batch_get_views(keys[:2]) == [None, None]
            assert store.batch_get_into(keys[:2], [bytearray(1), bytearray(1)]) == [False, False]
            assert store.stats()["errors"] >= errors + 2
        finally:
            self.restore_store(store)
        _eventually(lambda: store.batch_set([keys[4]], [b"e"]) == [True], "a write after the store came back")
        got = bytearray(1)
        assert store.batch_get_into([keys[4]], [got]) == [True] and got == b"e"
        assert [bytes(v) for v in store.batch_get_views([keys[4]]) if v is not None] == [b"e"]

    def test_closed_store_views_and_into_miss(self, store_url: str, keys: list[str]) -> None:
        store = self.open(store_url)
        store.close()
        assert store.batch_get_views([keys[0]]) == [None]
        assert store.batch_get_into([keys[0]], [bytearray(1)]) == [False]

    def test_namespaced_page_keys(self, store: KVStore) -> None:
        ns = StoreNamespace(f"kit-{self._run}:L2:H2:D4", "float16", 4)
        tokens = list(range(10))
        mine = ns.page_keys(tokens)
        assert len(mine) == 2 and mine == ns.page_keys(tokens + [99])
        other = [ns.page_keys(tokens, extra_key="lora-a"),
                 StoreNamespace(ns.layout, "bfloat16", 4).page_keys(tokens)]
        store.batch_set(mine, [b"p0", b"p1"])
        assert store.batch_exists(mine) == 2
        for keys in other:
            assert not set(keys) & set(mine)
            assert store.batch_exists(keys) == 0


# -- engines on a store: helpers for tier and fault tests -------------------------------------


def row_kv(cache: BasePrefixCache, req: Req, n: int) -> torch.Tensor:
    """K then V of every layer at the first ``n`` positions of ``req``'s row: ``(2 * layers, n, heads, dim)``."""
    import torch

    slots = cache.req_to_token_pool.req_to_token[req.kv.req_pool_idx][:n].to(torch.int64)
    pool = cache.kv_pool
    layers = range(pool.layer_num)
    return torch.stack([pool.get_key_buffer(i)[slots] for i in layers]
                       + [pool.get_value_buffer(i)[slots] for i in layers]).clone()


def serve_with_kv(
    cache: BasePrefixCache, rid: str, tokens: Iterable[int], seed: int = 0
) -> tuple[Req, int, torch.Tensor]:
    """Admit and prefill ``tokens`` through the engine, writing seeded random K/V for what was computed.

    Returns ``(req, prefix_len, kv)``: the running request (finish it), how many tokens
    the match gave, and ``row_kv`` of the whole prompt.
    """
    import torch

    from kvcore.testing.helpers import admit, make_req, prefill

    req = make_req(rid, list(tokens))
    assert admit(cache, req), f"{rid}: no req_to_token row"
    hit = len(req.prefix_indices)
    assert prefill(cache, req), f"{rid}: slots ran short"
    slots = cache.req_to_token_pool.req_to_token[req.kv.req_pool_idx][hit:len(req.fill_ids)].to(torch.int64)
    gen = torch.Generator().manual_seed(seed)
    pool = cache.kv_pool
    for i in range(pool.layer_num):
        shape = (slots.numel(), pool.head_num, pool.head_dim)
        pool.set_kv_buffer(i, slots, torch.randn(shape, generator=gen), torch.randn(shape, generator=gen))
    return req, hit, row_kv(cache, req, len(req.fill_ids))

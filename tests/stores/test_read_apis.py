"""``batch_get_views`` and ``batch_get_into``: the base class defaults for any store, frame checks, zero copies."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import kvcore
from kvcore.stores import FRAME_OVERHEAD, KVStore, frame, unframe, unframe_view
from kvcore.stores.framing import check_split


class DictStore(KVStore):
    """A store that implements only the four raw operations a third-party store must (no read fast path)."""

    def __init__(self) -> None:
        super().__init__("dict://")
        self.values: dict[str, bytes] = {}
        self.fail = False

    def _exists(self, keys: list[str]) -> list[bool]:
        return [k in self.values for k in keys]

    def _get(self, keys: list[str]) -> list[bytes | None]:
        if self.fail:
            raise ConnectionError("the dict went away")
        return [self.values.get(k) for k in keys]

    def _set(self, keys: list[str], values: list[bytes]) -> list[bool]:
        self.values.update(zip(keys, values, strict=True))
        return [True] * len(keys)

    def _clear(self) -> None:
        self.values.clear()


def test_a_store_with_only_the_raw_operations_has_every_read_api() -> None:
    s = DictStore()
    values = [os.urandom(n) for n in (0, 5, 70_000)]
    keys = ["a", "b", "c"]
    assert s.batch_set(keys, values) == [True] * 3
    assert [None if v is None else bytes(v) for v in s.batch_get_views([*keys, "absent"])] == [*values, None]
    buffers = [bytearray(len(v)) for v in values]
    assert s.batch_get_into(keys, buffers) == [True] * 3 and buffers == values
    s.values["b"] = b"garbage"
    assert s.batch_get_into(["b"], [bytearray(5)]) == [False]
    s.fail = True
    assert s.batch_get_views(keys) == [None] * 3
    assert s.batch_get_into(keys, buffers) == [False] * 3
    stats = s.stats()
    assert stats == {"hits": 6, "misses": 8, "errors": 3, "bytes_read": 2 * sum(map(len, values)),
                     "bytes_written": sum(map(len, values)), "round_trips": 6}


def test_memory_store_views_are_the_stored_bytes_not_copies() -> None:
    s = kvcore.open_store("memory://")
    s.batch_set(["k"], [b"payload"])
    (a,), (b,) = s.batch_get_views(["k"]), s.batch_get_views(["k"])
    assert a is not None and b is not None
    assert a == b"payload" and a.readonly and a.obj is b.obj


def test_into_a_torch_tensor_through_numpy() -> None:
    s = kvcore.open_store("memory://")
    page = torch.arange(64, dtype=torch.float16)
    s.batch_set(["page"], [page.numpy().tobytes()])
    dst = torch.zeros(2, 64, dtype=torch.float16)
    assert s.batch_get_into(["page", "none"], [dst[1].numpy(), dst[0].numpy()]) == [True, False]
    assert torch.equal(dst[1], page) and not dst[0].any()


def test_file_store_into_reads_the_file_once_into_the_buffer(tmp_path) -> None:
    s = kvcore.open_store(f"file://{tmp_path}")
    payload = os.urandom(300_000)
    s.batch_set(["k"], [payload])
    buf = np.zeros(300_000, dtype=np.uint8)
    assert s.batch_get_into(["k"], [buf]) == [True] and buf.tobytes() == payload
    # A file cut short after it was written: the size no longer holds, a miss counted as an error.
    path = s.path_of("k")  # type: ignore[attr-defined]
    path.write_bytes(path.read_bytes()[:-1])
    assert s.batch_get_into(["k"], [buf]) == [False] and s.stats()["errors"] == 1


@pytest.mark.parametrize("data", [b"", b"KVC1", frame("k", b"x")[:-1], frame("other", b"x"), b"\x00" * 40])
def test_unframe_view_refuses_what_unframe_refuses(data: bytes) -> None:
    assert unframe("k", data) is None and unframe_view("k", data) is None


def test_unframe_view_takes_any_buffer_without_copying() -> None:
    framed = bytearray(frame("k", b"hello"))
    view = unframe_view("k", memoryview(framed))
    assert view is not None and view == b"hello" and view.readonly and view.obj is framed
    assert unframe("k", framed) == b"hello"
    wide = np.frombuffer(bytes(frame("k", b"12345678")), dtype=np.uint8)
    assert unframe_view("k", memoryview(wide)) == b"12345678"


def test_check_split_needs_the_real_size() -> None:
    payload = os.urandom(100)
    header = frame("k", payload)[:FRAME_OVERHEAD]
    target = memoryview(bytearray(payload))
    assert check_split("k", header, FRAME_OVERHEAD + 100, target)
    # The payload is in the buffer, but the value read was shorter: a stale buffer, not a hit.
    assert not check_split("k", header, FRAME_OVERHEAD + 99, target)
    assert not check_split("k", header[:-1], FRAME_OVERHEAD + 100, target)
    assert not check_split("k2", header, FRAME_OVERHEAD + 100, target)
    target[0] ^= 1
    assert not check_split("k", header, FRAME_OVERHEAD + 100, target)


def test_frame_counts_bytes_not_items_of_a_wide_view() -> None:
    floats = memoryview(np.arange(4, dtype=np.float32))
    assert unframe("k", frame("k", floats)) == floats.tobytes()


def test_unchecked_reads_hand_over_what_the_checked_ones_refuse_and_never_raise() -> None:
    s = DictStore()
    s.batch_set(["good", "bad"], [b"payload", b"payload"])
    framed = bytearray(s.values["bad"])
    framed[-1] ^= 0xFF  # the checksum no longer holds
    s.values["bad"] = bytes(framed)
    assert s.batch_get_views(["good", "bad"])[1] is None
    got = s.batch_get_unchecked(["good", "bad", "absent"])
    assert [None if v is None else bytes(v) for v in got] == [b"payload", bytes(framed[FRAME_OVERHEAD:]), None]
    before = s.stats()
    s.fail = True
    assert s.batch_get_unchecked(["good"]) == [None]
    assert s.batch_get_unchecked([]) == []
    with pytest.raises(ValueError):
        s.batch_get_unchecked([""])
    assert s.stats()["errors"] == before["errors"] + 1

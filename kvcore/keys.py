"""Cache keys: token ids, optionally namespaced by an extra key."""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterator, Sequence
from typing import Any, SupportsIndex

import torch

__all__ = ["CheckedIds", "RadixKey", "KeyLike", "as_radix_key", "check_token_ids", "checked_key", "token_id_list"]

# A bool token id equals one of these: check_token_ids scans types only when one is present.
_UNSIGNED_CODES = frozenset("BHILQ")
_SIGNED_CODES = frozenset("bhilq")
_INT_CODES = _UNSIGNED_CODES | _SIGNED_CODES
_LITTLE = sys.byteorder == "little"
# From this many ids on, numpy (when importable) rules out 0/1 faster than a set probe per id.
_NUMPY_SCAN_FROM = 96
# From this many items on, an argmin over an 8-byte array in place beats copying its bytes for the sign test.
_NUMPY_SIGN_FROM = 2048
try:
    import numpy as _np
except ImportError:  # pragma: no cover - numpy comes with torch in practice
    _np = None  # type: ignore[assignment]


def _array_ids_valid(a: array) -> bool:
    """True when every item of an integer array is a valid id (non-negative, below 2**63).

    A signed array: no item negative.  An unsigned one: narrower than 8 bytes, or no
    item with its top bit set (>= 2**63) -- the same test of each item's high byte.
    """
    if a.typecode in _UNSIGNED_CODES and a.itemsize < 8:
        return True
    return _signed_array_nonneg(a)


def _signed_array_nonneg(a: array) -> bool:
    """True when no item of a signed integer array is negative: one C pass over its high bytes.

    A long 8-byte array (SGLang's ``array("q")`` prompts): one argmin over it in place instead.
    """
    s = a.itemsize
    if s == 8 and len(a) >= _NUMPY_SIGN_FROM:
        return _smallest_as_int64(a) >= 0
    raw = a.tobytes()
    # The sign bit lives in each item's most significant byte; all of them below 0x80 <=> none negative.
    return (raw[s - 1 :: s] if _LITTLE else raw[::s]).isascii()


def token_id_list(token_ids: Any) -> tuple[list, bool]:
    """``(ids as a list, already known valid)`` for any key container, converted in C (no per-token Python).

    Lists are taken as they are (not copied) and must still be checked.
    ``array`` (integer typecodes), 1-D integer numpy arrays and 1-D integer
    tensors become lists of exact ints through ``tolist()``; their ids are known
    valid once a sign test passes (a narrow unsigned container needs none; an
    8-byte one is tested for ids past int64), so a cache
    never scans them again.  Tuples, ranges and other sequences are copied into a
    list and checked later.  Raises TypeError for a float, bool or multi-dim
    container, or for something that is not a sequence of ids.
    """
    tp = type(token_ids)
    if tp is list:
        return token_ids, False
    if tp is array:
        code = token_ids.typecode
        if code in _INT_CODES:
            return token_ids.tolist(), _array_ids_valid(token_ids)
        raise TypeError(f"an array key must hold integers, got typecode {code!r}")
    if isinstance(token_ids, torch.Tensor):
        if token_ids.dim() != 1 or token_ids.is_floating_point() or token_ids.is_complex() \
                or token_ids.dtype == torch.bool:
            raise TypeError(
                "a tensor key must be a 1-D integer tensor, "
                f"got shape {tuple(token_ids.shape)} dtype {token_ids.dtype}"
            )
        ids = token_ids.tolist()
        return ids, _known_nonneg(ids, token_ids.dtype == torch.uint8)
    if _np is not None and isinstance(token_ids, _np.ndarray):
        kind = token_ids.dtype.kind
        if token_ids.ndim != 1 or kind not in "iu":
            raise TypeError(
                f"a numpy key must be a 1-D integer array, got shape {token_ids.shape} dtype {token_ids.dtype}"
            )
        ids = token_ids.tolist()
        return ids, _known_nonneg(ids, kind == "u")
    if isinstance(token_ids, RadixKey):
        return token_ids.token_ids, token_ids.validated
    if isinstance(token_ids, (tuple, range)):
        return list(token_ids), False
    if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Sequence):
        raise TypeError(
            "a key must be a RadixKey, a list of token ids, an array, a 1-D integer numpy array or tensor, "
            f"got {type(token_ids).__name__}"
        )
    return list(token_ids), False


def _known_nonneg(ids: list, unsigned: bool) -> bool:
    """Exact ints from ``tolist()``: valid unless one is negative or past int64 (then the full check names it)."""
    if not ids:
        return True
    if unsigned:  # non-negative already; an 8-byte unsigned container may hold ids past int64
        return max(ids) < 1 << 63
    try:
        array("Q", ids)
    except OverflowError:
        return False
    return True


class RadixKey:
    """A token-id sequence in a namespace.

    ``token_ids`` may be given as a list (kept as is, not copied), an
    ``array`` of integers (SGLang's own container), a 1-D integer numpy array or
    tensor, a tuple or a range; ``key.token_ids`` is always a list (converted
    in C).  An array is kept as given and turned into a list only when
    ``token_ids`` is first read, so a key that a cache only compares (an insert
    right after the match of the same tokens) is never converted.  Keys with
    different ``extra_key`` values (LoRA ids, cache salts) never share a
    prefix.  ``validated`` becomes True once every id is known valid (at once
    for an unsigned array, a tensor or a numpy array; for a list when
    ``as_radix_key`` or a cache checks it), so reusing one key for
    ``match_prefix`` and ``insert`` checks it once; a key's ids must not be
    changed in place after that.

    As in SGLang, indexing gives a key: ``key[i]`` is the one-token key
    ``key[i:i + 1]`` and a slice keeps the namespace (step 1 only); ``iter(key)``
    and ``key.token_ids[i]`` give the ids.
    """

    __slots__ = ("_ids", "_src", "extra_key", "validated")

    def __init__(self, token_ids: Any, extra_key: str | None = None):
        self._src: array | None = None
        if type(token_ids) is list:
            self._ids: list | None = token_ids
            self.validated = False
        elif type(token_ids) is array and token_ids.typecode in _INT_CODES:
            self._ids = None
            self._src = token_ids
            self.validated = _array_ids_valid(token_ids)
        else:
            self._ids, self.validated = token_id_list(token_ids)
        self.extra_key = extra_key

    @property
    def token_ids(self) -> list:
        ids = self._ids
        if ids is None:
            ids = self._ids = self._src.tolist()  # type: ignore[union-attr]
        return ids

    @token_ids.setter
    def token_ids(self, ids: list) -> None:
        self._ids, self._src = ids, None

    def same_prefix(self, other: RadixKey, n: int) -> bool:
        """Whether the first ``n`` ids of both keys are equal (``==``), as cheaply as their containers allow.

        Two arrays of one typecode compare in C without becoming lists; lists
        holding the same token objects (slices of one ``fill_ids``) compare by
        identity.  Namespaces are not compared.
        """
        a, b = self._src, other._src
        if a is not None and b is not None and a.typecode == b.typecode:
            return a == b if len(a) == len(b) == n else a[:n] == b[:n]
        x, y = self.token_ids, other.token_ids
        if x is y:
            return True
        return x == y if len(x) == len(y) == n else x[:n] == y[:n]

    def __len__(self) -> int:
        ids = self._ids
        return len(self._src if ids is None else ids)  # type: ignore[arg-type]

    def __getitem__(self, item: SupportsIndex | slice) -> RadixKey:
        if not isinstance(item, slice):
            n = len(self)
            i = item.__index__()
            if i < 0:
                i += n
            if not 0 <= i < n:
                raise IndexError(f"RadixKey index out of range: {item}")
            item = slice(i, i + 1)
        elif item.step not in (None, 1):
            raise ValueError("RadixKey slice step must be 1")
        src = self._src
        part = RadixKey(src[item] if self._ids is None and src is not None else self.token_ids[item], self.extra_key)
        part.validated = self.validated
        return part

    def __iter__(self) -> Iterator[int]:
        return iter(self.token_ids)

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, RadixKey)
            and self.extra_key == other.extra_key
            and len(self) == len(other)
            and self.same_prefix(other, len(self))
        )

    def __hash__(self) -> int:
        return hash((self.extra_key, tuple(self.token_ids)))

    def __repr__(self) -> str:
        ids = self.token_ids if len(self) <= 8 else f"{self.token_ids[:8]}...+{len(self) - 8}"
        return f"RadixKey({ids}, extra_key={self.extra_key!r})"


KeyLike = RadixKey | Sequence[int] | torch.Tensor | array


def as_radix_key(key: KeyLike, *, validate: bool = True) -> RadixKey:
    """Turn a key-like value into a RadixKey, or raise naming what is wrong.

    Accepts a RadixKey, a list/tuple/range of ints, an integer ``array``, or a
    1-D integer numpy array or tensor (converted in C, never per token in
    Python).  Token ids must be non-negative ints below 2**64.
    """
    if type(key) is RadixKey:
        result = key
    elif type(key) is list:
        # No copy: caches slice what they keep, so sharing the caller's list is safe.
        result = RadixKey(key)
    elif isinstance(key, RadixKey):
        result = key
    else:
        result = RadixKey(key)
    if validate and not result.validated:
        if result.token_ids:
            check_token_ids(result.token_ids)
        result.validated = True
    return result


class CheckedIds(list):
    """Token ids (exact ints) that whoever made the list proved valid: :func:`check_token_ids` does not scan them.

    For ids converted from a container already proven valid (a validated :class:`RadixKey`'s,
    an ``array`` that passed its sign test), handed to code that checks every list it gets
    (a resumed insert's part of a request's ids).  As with a validated key, its ids must not
    be changed in place.  Its slices are plain lists.
    """

    __slots__ = ()


def check_token_ids(ids: list, start: int = 0, *, refuse_bools: bool = True) -> bool:
    """Raise unless ``ids[start:]`` are non-negative ints below 2**63: the one token-id check.

    2**63: a token id must fit SGLang's token container, ``array("q")`` (signed 64-bit),
    and the int64 tensors the trees compare and store.

    Returns True when those ids are known to hold no 0 or 1 (so an equal list
    can hold no bool either), False when that is unknown or untrue.

    Bools are ints to Python but never token ids: refused too (a cache built
    with ``strict=False`` skips that with ``refuse_bools=False``).  A bool
    equals 0 or 1, so the type scan runs only when a 0 or 1 is present; the
    smallest converted id (one numpy argmin for long keys) rules that out, and
    negative ids with it.

    ``array("q", ...)`` converts in C and refuses floats, strings and ids past
    int64 in one pass, so a valid key costs no per-token Python loop; only a
    refused key is walked again to name the first bad id:

    * ``TypeError("token ids must be ints, got float (1.5)")``
    * ``ValueError("token ids must be non-negative, got -1")``
    * ``ValueError("token id 9223372036854775808 does not fit in a signed 64-bit int")``

    A :class:`CheckedIds` is valid by construction: answered at once (False: not scanned for a 0 or 1).
    """
    if type(ids) is CheckedIds:
        return False
    if start >= len(ids):
        return True
    rest = ids[start:] if start else ids
    try:
        # One C pass: refuses floats, strings, negative and too-large numbers at once ("Q" converts
        # about twice as fast as "q"; ids past int64 show up below as negative int64 reads).
        converted = array("Q", rest)
    except (TypeError, OverflowError, ValueError) as exc:
        error: Exception = exc
    else:
        low = _smallest_as_int64(converted)
        if low >= 0:
            if not refuse_bools:
                return False
            if low > 1:
                return True  # no 0 or 1, so no bool either
            if bool in map(type, rest):
                raise TypeError(f"token ids must be ints, got bool ({next(t for t in rest if type(t) is bool)!r})")
            return False
        error = ValueError("an id past int64")
    for t in rest:
        if isinstance(t, bool) or not isinstance(t, int):
            raise TypeError(f"token ids must be ints, got {type(t).__name__} ({t!r})") from None
        if t < 0:
            raise ValueError(f"token ids must be non-negative, got {t}") from None
        if t >= 1 << 63:
            raise ValueError(f"token id {t} does not fit in a signed 64-bit int (array('q'), int64)") from None
    raise TypeError(f"token ids must be non-negative ints below 2**63 ({error})") from None


def _smallest_as_int64(converted: array) -> int:
    """The smallest id of an ``array("Q")`` read as int64: negative when one id is 2**63 or more.

    One argmin and one read for long keys (a fraction of min()'s reduction overhead).
    """
    if _np is not None and len(converted) >= _NUMPY_SCAN_FROM:
        v = _np.frombuffer(converted, _np.int64)
        return int(v[v.argmin()])
    return -1 if max(converted) >> 63 else min(converted)


def checked_key(key: KeyLike) -> RadixKey:
    """``as_radix_key(key)``: a RadixKey whose ids are checked (once: the key remembers it)."""
    return as_radix_key(key)

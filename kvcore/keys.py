"""Cache keys: token ids, optionally namespaced by an extra key."""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import torch

__all__ = ["RadixKey", "KeyLike", "as_radix_key", "check_token_ids", "checked_key"]

# A bool token id equals one of these: check_token_ids scans types only when one is present.
_ZERO_ONE = frozenset((0, 1))


class RadixKey:
    """A token-id sequence in a namespace.

    Keys with different ``extra_key`` values (LoRA ids, cache salts) never share
    a prefix.  Slicing keeps the namespace.  ``validated`` becomes True once every
    id has been checked (by ``as_radix_key`` or a cache), so reusing one key for
    ``match_prefix`` and ``insert`` checks it once; a key's ids must not be
    changed in place after that.
    """

    __slots__ = ("token_ids", "extra_key", "validated")

    def __init__(self, token_ids: Sequence[int], extra_key: str | None = None):
        self.token_ids = token_ids if isinstance(token_ids, list) else list(token_ids)
        self.extra_key = extra_key
        self.validated = False

    def __len__(self) -> int:
        return len(self.token_ids)

    def __getitem__(self, item):
        if isinstance(item, slice):
            part = RadixKey(self.token_ids[item], self.extra_key)
            part.validated = self.validated
            return part
        return self.token_ids[item]

    def __iter__(self):
        return iter(self.token_ids)

    def __eq__(self, other) -> bool:
        return (
            isinstance(other, RadixKey)
            and self.extra_key == other.extra_key
            and self.token_ids == other.token_ids
        )

    def __hash__(self) -> int:
        return hash((self.extra_key, tuple(self.token_ids)))

    def __repr__(self) -> str:
        ids = self.token_ids if len(self.token_ids) <= 8 else f"{self.token_ids[:8]}...+{len(self.token_ids) - 8}"
        return f"RadixKey({ids}, extra_key={self.extra_key!r})"


KeyLike = RadixKey | Sequence[int] | torch.Tensor


def as_radix_key(key: KeyLike, *, validate: bool = True) -> RadixKey:
    """Turn a key-like value into a RadixKey, or raise naming what is wrong.

    Accepts a RadixKey, a list/tuple/range of ints, or a 1-D integer tensor.
    Token ids must be non-negative ints.
    """
    if isinstance(key, RadixKey):
        ids = key.token_ids
        result = key
    elif type(key) is list:
        # No copy: caches slice what they keep, so sharing the caller's list is safe.
        ids = key
        result = RadixKey(ids)
    elif isinstance(key, torch.Tensor):
        if key.dim() != 1 or key.is_floating_point() or key.is_complex():
            raise TypeError(
                f"a tensor key must be a 1-D integer tensor, got shape {tuple(key.shape)} dtype {key.dtype}"
            )
        ids = key.tolist()
        result = RadixKey(ids)
    elif isinstance(key, (list, tuple, range)):
        ids = list(key)
        result = RadixKey(ids)
    else:
        raise TypeError(
            f"a key must be a RadixKey, a list of token ids or a 1-D integer tensor, got {type(key).__name__}"
        )
    if validate and not result.validated:
        if ids:
            check_token_ids(ids)
        result.validated = True
    return result


def check_token_ids(ids: list, start: int = 0, *, refuse_bools: bool = True) -> None:
    """Raise unless ``ids[start:]`` are non-negative ints below 2**64: the one token-id check.

    Bools are ints to Python but never token ids: refused too (one more C pass,
    about 8 ns a token, 20 more when an id equals 0 or 1; a cache built with ``strict=False`` skips it with
    ``refuse_bools=False``).

    ``array("Q", ...)`` converts in C and refuses floats, strings, negative and
    too-large numbers in one pass, so a valid key costs no per-token Python loop;
    only a refused key is walked again to name the first bad id:

    * ``TypeError("token ids must be ints, got float (1.5)")``
    * ``ValueError("token ids must be non-negative, got -1")``
    * ``ValueError("token id 18446744073709551616 does not fit in 64 bits")``
    """
    if start >= len(ids):
        return
    rest = ids[start:] if start else ids
    try:
        array("Q", rest)
    except (TypeError, OverflowError, ValueError) as exc:
        error = exc
    else:
        # A bool equals 0 or 1 (and hashes alike): a key holding neither (most tails) needs no
        # per-token type scan, and this set probe costs about half of ``bool in map(type, rest)``.
        if refuse_bools and not _ZERO_ONE.isdisjoint(rest) and bool in map(type, rest):
            raise TypeError(f"token ids must be ints, got bool ({next(t for t in rest if type(t) is bool)!r})")
        return
    for t in rest:
        if isinstance(t, bool) or not isinstance(t, int):
            raise TypeError(f"token ids must be ints, got {type(t).__name__} ({t!r})") from None
        if t < 0:
            raise ValueError(f"token ids must be non-negative, got {t}") from None
        if t >= 1 << 64:
            raise ValueError(f"token id {t} does not fit in 64 bits") from None
    raise TypeError(f"token ids must be non-negative ints below 2**64 ({error})") from None


def checked_key(key: KeyLike) -> RadixKey:
    """``as_radix_key(key)``: a RadixKey whose ids are checked (once: the key remembers it)."""
    rk = as_radix_key(key, validate=False)
    if not rk.validated:
        check_token_ids(rk.token_ids)
        rk.validated = True
    return rk

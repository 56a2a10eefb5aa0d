"""The token ids a cache call hands kvcore, read from SGLang's request arrays without copying them whole.

Version-neutral: SGLang 0.5.19 and 0.5.23 keep a request's ids in ``origin_input_ids``,
``output_ids`` and ``full_untruncated_fill_ids`` (``array('q')``).  How long a call's fill
is (``fill_len``) differs between versions and lives in each version's request views.
"""

from __future__ import annotations

import weakref
from array import array
from typing import Any, cast

import kvcore
from kvcore.keys import CheckedIds

__all__ = ["NO_IDS", "FillIds", "MatchedIds", "RequestTables", "namespace"]


def namespace(extra_key: str | None, cache_salt: str | None) -> Any:
    """kvcore's ``extra_key`` for SGLang's pair: keys differing in either never share a prefix (SGLang's child_key)."""
    return extra_key if cache_salt is None else (extra_key, cache_salt)


class MatchedIds:
    """The list kvcore's match made of a request's token ids, and the SGLang arrays it was made from.

    SGLang's ``Req.init_next_round_input`` matches ``full_untruncated_fill_ids`` (capped by
    the key's ``limit``), and kvcore's trees read that key as a list: every prompt id becomes
    an ``int`` object once.  The request's later cache calls insert the same prompt ids
    again, chunk by chunk; they take them from this list (a slice: no conversion, and the
    tree's keys share these ``int`` objects) instead of converting SGLang's array again.

    Taken on trust, as SGLang's own path and kvcore's resumed insert take it: the prompt of a
    request is not rewritten in place while it runs (SGLang rebuilds ``full_untruncated_fill_ids``
    when it changes more than its tail, and an abort gives ``origin_input_ids`` a new array).
    So the list counts only while the request still holds the very arrays it was made from,
    and only over the prompt (``origin_input_ids``): outputs come from SGLang's arrays.
    """

    __slots__ = ("req", "full", "origin", "ids")

    def __init__(self, req: Any, full: Any, ids: list[int]):
        self.req = weakref.ref(req)
        self.full = full
        self.origin = req.origin_input_ids
        self.ids = ids

    def stands_for(self, req: Any) -> bool:
        """Whether the list still stands for ``req``'s prompt: made for it, from the arrays it holds now."""
        owner: Any = self.req()
        return owner is req and self.full is req.full_untruncated_fill_ids and self.origin is req.origin_input_ids

    def prompt_len(self) -> int:
        """How many of the first ids the list covers (its length, at most the prompt's)."""
        return min(len(self.ids), len(self.origin))


class RequestTables:
    """What a kvcore cache keeps per SGLang ``Req`` that SGLang's ``Req`` has no field for (weakly keyed).

    ``matched``: the latest match's :class:`MatchedIds` (one, whatever request it was);
    ``ids``: those of a request in chunked prefill, kept from chunk to chunk until it finishes.
    """

    __slots__ = ("locks", "ids", "matched")

    def __init__(self) -> None:
        self.locks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.ids: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.matched: MatchedIds | None = None

    def known_ids(self, req: Any, *, keep: bool | None = None) -> tuple[list[int], int] | None:
        """``req``'s prompt ids as its match listed them and how many count (None: no such list holds).

        ``keep``: True keeps them for the request's next call (a chunk of a chunked prefill),
        False drops them (its last call), None leaves the table as it is.
        """
        entry = self.ids.get(req)
        if entry is None or not entry.stands_for(req):
            matched = self.matched
            entry = matched if matched is not None and matched.stands_for(req) else None
        if keep:
            if entry is not None:
                self.ids[req] = entry
        elif keep is not None:
            self.ids.pop(req, None)
        return None if entry is None else (entry.ids, entry.prompt_len())


class FillIds:
    """The token ids one cache call hands kvcore: the first ``end`` of SGLang's arrays ``parts`` joined.

    Read as lists only over the range asked (``slice``), never joined or copied whole: a
    resumed chunk costs its own length, not the prompt's.  The first ``known_len`` ids come
    from ``known`` (:class:`MatchedIds`: the list the request's match made, of a key it
    validated), the rest from the arrays (``tolist()`` in C).  Both are valid ids once an
    array passed its sign test, so a slice is a :class:`~kvcore.keys.CheckedIds` that
    kvcore's insert does not scan again; one with a bad id is a plain list, which kvcore
    checks and refuses, naming it.
    """

    __slots__ = ("parts", "end", "known", "known_len")

    def __init__(self, parts: tuple, end: int, known: tuple[list[int], int] | None = None):
        self.parts = parts
        self.end = min(end, sum(len(p) for p in parts))
        self.known: list[int] | None = None
        self.known_len = 0
        if known is not None:
            self.known, self.known_len = known

    def __len__(self) -> int:
        return self.end

    def slice(self, start: int, end: int) -> list[int]:
        """``ids[start:end]`` (clipped to ``end``) as a new list."""
        end = min(end, self.end)
        if start >= end:
            return []
        n = self.known_len
        if start < n:
            ids = CheckedIds(cast(list, self.known)[start:min(end, n)])  # known_len > 0: a list is known
            start = n
        else:
            ids = CheckedIds()
        valid = True
        offset = 0
        for part in self.parts:
            lo, hi = max(start - offset, 0), min(end - offset, len(part))
            if lo < hi:
                piece = part[lo:hi]
                if type(piece) is array:
                    key = kvcore.RadixKey(piece)  # its sign test, in C; token_ids: tolist()
                    valid = valid and key.validated
                    ids += key.token_ids
                else:
                    valid = False
                    ids += piece
            offset += len(part)
            if offset >= end:
                break
        return ids if valid else list(ids)


#: No token ids (a ChunkCache call caches none; a match's view inserts none).
NO_IDS = FillIds((), 0)

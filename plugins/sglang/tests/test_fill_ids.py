"""The token ids kvcore-sglang hands kvcore per cache call: read over SGLang's arrays, the prompt's from its match.

``FillIds`` reads only the range a call asks for (never the whole prefix again per chunk);
``RequestTables.known_ids`` gives a request's prompt ids as its match listed them, only while
the request holds the very arrays they were made from.  That the answers stay SGLang's is
the request-path differential's job (test_request_path_differential.py and the others).
"""

from __future__ import annotations

from array import array

import pytest
from kvcore_sglang.v0_5_19 import NO_IDS, FillIds, MatchedIds, RequestTables, fill_len
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.sampling.sampling_params import SamplingParams

from kvcore.keys import CheckedIds, check_token_ids

PROMPT = list(range(100, 140))


def sglang_req(rid: str = "r") -> Req:
    req = Req(rid, "", array("q", PROMPT), SamplingParams())
    req.full_untruncated_fill_ids = req.origin_input_ids + req.output_ids
    return req


@pytest.mark.parametrize("known_len", [0, 10, 40])
def test_slices_join_the_known_list_and_the_arrays(known_len):
    out = array("q", [7, 8, 9])
    known = (PROMPT[:known_len], known_len) if known_len else None
    fill = FillIds((array("q", PROMPT), out), 42, known)
    whole = PROMPT + [7, 8]
    assert len(fill) == 42
    for start, end in [(0, 42), (0, 5), (5, 10), (8, 12), (38, 42), (40, 99), (41, 41), (50, 60)]:
        part = fill.slice(start, end)
        assert part == whole[start:end]
        # Valid ids from a sign-tested array: kvcore's insert does not scan them again.
        assert type(part) is (CheckedIds if part else list)


def test_a_bad_id_gives_a_plain_list_which_kvcore_refuses():
    fill = FillIds((array("q", [5, -1, 6]),), 3)
    part = fill.slice(0, 3)
    assert type(part) is list and part == [5, -1, 6]
    with pytest.raises(ValueError, match="non-negative, got -1"):
        check_token_ids(part)


def test_no_ids_and_fill_len_without_the_copy():
    assert len(NO_IDS) == 0 and NO_IDS.slice(0, 5) == []
    req = sglang_req()
    req.set_extend_range(0, 16)
    assert fill_len(req) == len(req.get_fill_ids()) == 16
    req.set_extend_range(0, 99)
    assert fill_len(req) == len(req.get_fill_ids()) == len(PROMPT)


def test_known_ids_only_while_the_request_holds_the_arrays_they_were_made_from():
    tables = RequestTables()
    req, other = sglang_req("r"), sglang_req("o")
    listed = req.full_untruncated_fill_ids.tolist()
    tables.matched = MatchedIds(req, req.full_untruncated_fill_ids, listed)
    assert tables.known_ids(other) is None
    ids, n = tables.known_ids(req, keep=True)  # a chunk of a chunked prefill: kept for the next
    assert ids is listed and n == len(PROMPT)
    tables.matched = MatchedIds(other, other.full_untruncated_fill_ids, other.full_untruncated_fill_ids.tolist())
    assert tables.known_ids(req)[0] is listed  # another request's match does not drop it
    # SGLang rebuilds full_untruncated_fill_ids when more than its tail changes: the list no longer counts.
    req.full_untruncated_fill_ids = req.origin_input_ids + req.output_ids
    assert tables.known_ids(req) is None
    tables.matched = MatchedIds(req, req.full_untruncated_fill_ids, listed)
    # An abort gives the request a one-token prompt, a new array (what Req.set_finish_with_abort does; it
    # also logs through SGLang's parallel state, which a CPU test has none of): not its prompt any more.
    req.origin_input_ids = array("q", [0])
    assert tables.known_ids(req, keep=False) is None and req not in tables.ids


def test_known_ids_cover_the_prompt_only():
    tables = RequestTables()
    req = sglang_req()
    req.output_ids.extend([1, 2])
    req.full_untruncated_fill_ids.extend([1, 2])  # what SGLang's _refresh_fill_ids does
    tables.matched = MatchedIds(req, req.full_untruncated_fill_ids, req.full_untruncated_fill_ids.tolist())
    ids, n = tables.known_ids(req, keep=False)
    assert len(ids) == len(PROMPT) + 2 and n == len(PROMPT)  # outputs are read from SGLang's arrays

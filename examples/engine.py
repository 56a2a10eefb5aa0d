#!/usr/bin/env python
"""An engine on top of kvcore, start to finish: the README's "Using it from an engine", runnable.

kvcore does the KV-cache bookkeeping; the engine computes the KV.  This script
plays the engine with ``kvcore.engine.Engine``, the one driver of kvcore's
engine protocol:

1. build a radix prefix cache (its pools come with it);
2. serve three requests that share a system prompt: admission matches the
   cached prefix, prefill runs in chunks, decode runs in batched steps,
   finish hands the KV to the tree;
3. run a two-turn conversation on a streaming session, so turn two reuses
   turn one's KV without going through the tree;
4. prove with the invariant checker that no slot leaked.

It prints, per request, how many prompt tokens came from the cache (the hit).

    python examples/engine.py
"""

from __future__ import annotations

import torch

import kvcore
from kvcore.engine import Engine

PAGE = 16
CHUNK = 64  # prefill budget per step (SGLang's chunked_prefill_size)


def tokens(start: int, n: int) -> list[int]:
    """Stand-in token ids (a tokenizer's output in a real engine)."""
    return [(start + i) % 30000 + 1 for i in range(n)]


def main() -> None:
    # -- 1. the cache and its pools --------------------------------------------------
    # 4096 token slots in pages of 16, 8 request rows of up to 1024 tokens each.
    cache = kvcore.create_cache("radix", size=4096, page_size=PAGE, max_num_reqs=8, max_context_len=1024)

    # K/V buffers are the engine's: here a tiny one, written wherever the engine allocates.
    kv_buffer = torch.zeros(4096 + PAGE, dtype=torch.float32)

    def write_kv(slots: torch.Tensor) -> None:
        kv_buffer[slots] = 1.0  # the model's forward pass writes K and V at these slots

    engine = Engine(cache, kv_writer=write_kv)

    # -- 2. three requests sharing a 160-token system prompt -------------------------
    system = tokens(1000, 160)
    prompts = {
        "a": system + tokens(5000, 40),
        "b": system + tokens(6000, 25),
        "c": system + tokens(7000, 90),
    }
    running: list[kvcore.Req] = []
    hits: dict[str, int] = {}
    for rid, prompt in prompts.items():
        req = kvcore.Req(rid, prompt)
        # Admission: match_prefix on the prompt (all but its last token), lock the
        # matched node, take a req_to_token row and write the cached slots into it.
        assert engine.admit(req), "out of request rows"
        hits[rid] = req.kv.cache_protected_len
        # Prefill in chunks: each chunk allocates slots, commits them and tells the
        # cache (cache_unfinished_req); when the prompt is complete it enters the tree,
        # so the next request shares it while this one still decodes.
        while req.kv.kv_committed_len < len(prompt):
            assert engine.extend(req, req.kv.kv_committed_len + CHUNK), "out of KV slots"
        print(f"{rid}: prompt {len(prompt):4d} tokens, {hits[rid]:4d} from the cache")
        running.append(req)

    # Decode: one batched step at a time, a slot and a sampled token per request.
    for step in range(24):
        sampled = [100 + step] * len(running)  # the sampler's output in a real engine
        assert engine.decode(running, sampled) == len(running)
        # Finish requests that reached their length (here: after 8, 16 and 24 tokens).
        for req in [r for r in running if len(r.output_ids) == 8 * (1 + "abc".index(r.rid))]:
            running.remove(req)
            engine.finish(req)  # kvcore.release_kv_cache: tree insert, frees, row back
        engine.check(running)  # the requests alive now own the rest

    # A late request sees everything the first three left in the tree.
    late = kvcore.Req("d", prompts["c"] + [100, 101, 102] + tokens(9000, 10))
    assert engine.admit(late)
    hits["d"] = late.kv.cache_protected_len  # whole pages only: 240 of the 253 tokens c left
    assert engine.extend(late)
    print(f"d: prompt {len(late.origin_input_ids):4d} tokens, {hits['d']:4d} from the cache")
    engine.finish(late)

    # -- 3. a conversation on a streaming session ------------------------------------
    sessions = kvcore.StreamingSession(cache)
    chat = Engine(sessions, kv_writer=write_kv)
    turn1 = kvcore.Req("t1", system + tokens(11000, 30), session_id="chat")
    assert chat.admit(turn1)
    hits["t1"] = turn1.kv.cache_protected_len  # the system prompt, from the tree
    print(f"t1: prompt {len(turn1.origin_input_ids):4d} tokens, {hits['t1']:4d} from the cache")
    assert chat.extend(turn1)
    for step in range(5):
        chat.decode([turn1], [200 + step])
    chat.finish(turn1)  # the session keeps turn one's KV (row and all)

    # Turn two extends turn one's whole text; admission hands it the session's record.
    turn2 = kvcore.Req("t2", turn1.fill_ids + tokens(12000, 20), session_id="chat")
    assert chat.admit(turn2)
    assert turn2.kv is sessions.slots["chat"].kv  # the same record, the same row
    hits["t2"] = turn2.kv.kv_committed_len  # every token of turn one, page-aligned or not
    print(f"t2: prompt {len(turn2.origin_input_ids):4d} tokens, {hits['t2']:4d} from the session")
    assert chat.extend(turn2)
    chat.decode([turn2], [300])
    chat.finish(turn2)
    chat.end_session("chat")  # the conversation is over: its KV goes back

    # -- 4. nothing leaked -------------------------------------------------------------
    reports = engine.check([])
    for r in reports:
        print(f"pool {r.pool}: {r.total} slots, {r.available} free, {r.evictable} cached (evictable), "
              f"{r.protected} locked, {r.uncached} held by requests")
    cache.evict(10**9)  # drop everything the tree keeps
    engine.check([])
    full = cache.pools()[0]
    assert full.available() == full.capacity
    print("invariants hold: every slot is back")


if __name__ == "__main__":
    main()

"""The tree kit: what every radix-tree prefix cache needs, for kvcore's backends and yours.

kvcore's ``radix``, ``swa`` and ``unified`` backends are built on it; a third-party tree
backend (a new eviction scheme, a new kind of per-node state) uses the same
pieces and keeps only its own policy code.  Everything here is plain functions
and ``__slots__`` classes: no per-call dispatch on the hot path.

Keys
    :func:`check_token_ids` (``ids[start:]`` are non-negative ints below 2**63,
    one C pass; TypeError/ValueError naming the first bad id otherwise) and
    :func:`checked_key` (any key-like value -> a checked :class:`kvcore.RadixKey`).
    A key may come as a list, an ``array`` (SGLang's ``array("q")``), a 1-D
    integer numpy array or tensor: ``key.token_ids`` is always a list, made in
    C (:func:`token_id_list`); ``key.same_prefix(other, n)`` compares two keys
    without converting arrays.  Keys with different ``extra_key`` never share a prefix.
    :func:`check_evict_count` (an ``evict`` count: TypeError for a non-int,
    ValueError when negative); :func:`request_ids` (a request's first ``n``
    ``fill_ids``: ValueError naming it when it holds fewer; :func:`check_request_ids`
    is that check alone, without building the ids).

Slots a tree keeps
    With the common ``strict`` option on (the default), a tree claims the slots
    it keeps: ``allocator.check_claimable(slots, commit=True)`` before changing
    anything (refuses padding, out-of-range, free, duplicated slots and slots
    another node owns), ``allocator.disown(slots)`` before freeing them.

Walking a key
    :func:`child_key` (the dict key of an edge: its first token, or first page as
    a tuple, under ``(extra_key, page)`` at the root for another namespace) and
    :func:`prefix_match_len` (the matched length of an edge, floored to whole
    pages, by list-slice comparisons)::

        node, pos = root, 0                 # ids: the key's token ids, n: their page-aligned length
        while pos < n:
            child = node.children.get(child_key(ids, pos, ps, extra_key if pos == 0 else None))
            if child is None:
                break
            end = pos + len(child.key)
            if end <= n and ids[pos:end] == child.key:  # the whole edge: one comparison
                node, pos = child, end
                continue
            m = prefix_match_len(ids, pos, child.key, n - pos, ps)
            node = split_node(child, m, MyNode(), ps)   # the matched part becomes a node of its own
            pos += m
            break

    :func:`edge_match_len` is the two steps on one edge (the whole-edge
    comparison, then :func:`prefix_match_len`; below ``len(key)``: split there).
    :func:`descend` is that walk read-only (``(path, pos, child, m)``: the whole
    edges matched, their length, the edge a match ends inside and its matched
    length): a tree validates the rest of a key, or reuses the walk, before it
    changes anything.

Nodes
    :class:`Node` (``__slots__`` base: children, parent, key, value, ck,
    extra_key, id, lock_ref, last_access_time, hit_count, hash_value).  A
    subclass adds slots and lists the ones a split must carry in
    ``split_copy`` / ``split_move``; :func:`split_node` cuts an edge and carries
    them, the page hashes and the dict position.  :func:`path_to_root`,
    :func:`check_locked`, :func:`lock_path`, :func:`unlock_path` are the lock
    walks (a lock covers the path to the root); :func:`iter_subtree` visits a
    subtree; :func:`tree_lines` lays it out for a ``pretty_print``;
    :data:`next_node_id` numbers nodes in creation order.

Values
    :func:`join_values` (parts of a match as one slot tensor, no copy for one
    part), :func:`path_values` (the slots of the path down to a node), :func:`proven_prefix_len`
(the one rule for ``prev_prefix_len``: it never narrows a strict check) and
    :func:`checked_value` (an insert's ``value`` as int64 slots: TypeError /
    ValueError before anything changes); :func:`alloc_value` (fresh slots for
    ``insert(key, value=None)``, RuntimeError when the pools are full).

Order
    :class:`LRUList`, an intrusive doubly linked list (a node carries its own
    links, so several lists can hold one node); ``touch_path(node, root,
    limit_tokens)`` moves a path (or its deepest ``limit_tokens``) to the front.  Heap-ordered eviction uses the
    policies of :mod:`kvcore.tree.policies` (``lru``, ``lfu``, ``fifo``, ``mru``,
    ``filo``, ``priority``, ``slru`` and any a plugin registers through
    ``kvcore_register_eviction_policies``), built by name with :func:`resolve_policy`;
    :class:`EvictionStrategy` is their base and ``BUILTIN_POLICIES`` maps the
    built-in names to their classes.  :class:`EvictOrder` keeps a tree's evictable
    leaves in a policy's order (:mod:`kvcore.tree.evict_order`): a set (``add``,
    ``discard``, ``difference_update``, ``in``, ``len``, iteration) whose ``pop()``
    gives the next victim in O(log n), in the order a per-call heap of every leaf
    would; call ``refresh()`` once before the pops of each eviction (it re-ranks
    every leaf for a policy that is not ``monotone``, e.g. ``mru``).

Resumed inserts
    :class:`ResumableInsert` (a mixin before ``BasePrefixCache``): a running request's next
    prefill chunk goes in from its locked node with only its new tokens and slots, as the
    whole-prefix re-insert would leave everything; the backend supplies ``resume_insert``,
    ``resume_stamp`` and ``resume_lock``.  :class:`ResumePoint` is what the tree keeps for a running
    request (by row, in ``resume_points``): the locked node and a buffer of the path's slots, grown by
    :func:`grow_slots`; :func:`path_below` writes the slots of the nodes a resumed insert hung below
    the locked node (the one tree resumes its component sets with these too).

KV events
    :mod:`kvcore.tree.events`: :class:`PageStored`, :class:`PageRemoved`,
    :class:`AllPagesCleared`, chained SHA-256 page hashes (:func:`page_hash`,
    :func:`chain_page_hashes`) and :func:`record_stored` / :func:`record_removed`
    for a node.  :class:`KVEventLog` (a mixin before ``BasePrefixCache``) gives a
    cache ``take_events()`` over its ``_events`` list and ``record_cleared()`` for ``reset()``.

Conventions a tree backend follows so the rest of kvcore can check it: node
keys are whole pages (``len(key) % page_size == 0``); ``value`` holds the
node's full-pool slots; a node taken out of the tree gets ``parent = None``;
the cache yields every node's slots from ``iter_owned_slots()`` and reports
its (evictable, protected) counts per pool from ``cached_sizes()``.
"""

from kvcore.keys import check_token_ids, checked_key, token_id_list
from kvcore.tree.checks import check_evict_count, check_request_ids, request_ids
from kvcore.tree.events import (
    AllPagesCleared,
    KVEventLog,
    PageRemoved,
    PageStored,
    chain_page_hashes,
    page_hash,
    record_removed,
    record_stored,
)
from kvcore.tree.evict_order import EvictOrder
from kvcore.tree.lru import LRUList
from kvcore.tree.match import child_key, descend, edge_match_len, prefix_match_len
from kvcore.tree.node import (
    Node,
    check_locked,
    iter_subtree,
    lock_path,
    next_node_id,
    path_to_root,
    split_node,
    tree_lines,
    unlock_path,
)
from kvcore.tree.policies import BUILTIN_POLICIES, EvictionStrategy, resolve_policy
from kvcore.tree.resume import ResumableInsert, ResumePoint, grow_slots, path_below
from kvcore.tree.values import alloc_value, checked_value, join_values, path_values, proven_prefix_len

__all__ = [
    "AllPagesCleared",
    "BUILTIN_POLICIES",
    "EvictOrder",
    "EvictionStrategy",
    "KVEventLog",
    "LRUList",
    "Node",
    "PageRemoved",
    "PageStored",
    "ResumableInsert",
    "ResumePoint",
    "alloc_value",
    "chain_page_hashes",
    "check_evict_count",
    "check_locked",
    "check_request_ids",
    "check_token_ids",
    "checked_key",
    "checked_value",
    "child_key",
    "descend",
    "edge_match_len",
    "grow_slots",
    "iter_subtree",
    "join_values",
    "lock_path",
    "next_node_id",
    "page_hash",
    "path_below",
    "path_to_root",
    "path_values",
    "proven_prefix_len",
    "prefix_match_len",
    "record_removed",
    "record_stored",
    "request_ids",
    "resolve_policy",
    "split_node",
    "token_id_list",
    "tree_lines",
    "unlock_path",
]

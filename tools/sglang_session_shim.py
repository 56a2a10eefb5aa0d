"""Load SGLang's own ``StreamingSession`` (``srt/session/streaming_session.py``) on the CPU.

    from tools.sglang_session_shim import load_sglang_session
    ss = load_sglang_session("/tmp/sgl/src", npu=False)
    session = ss.StreamingSession(inner)          # any object with SGLang's cache surface

``streaming_session.py`` imports ``ReqKvInfo`` from ``managers/schedule_batch.py``,
which pulls in the whole scheduler; so the ``ReqKvInfo`` class is lifted from that
file by AST into a small stand-in module (with a ``FINISH_ABORT`` class, which
``try_cache_finished_req`` imports from there), and the session module itself is
executed from SGLang's file with ``tools.sglang_shim``'s stubs for the rest.
``npu`` sets what ``is_npu()`` answers (the page-aligned reuse path).  Nothing is
copied into this repository.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import sys
import types
from typing import Any, Optional

import torch

from tools.sglang_shim import load_sglang

__all__ = ["load_sglang_session"]


def _exec_classes(path: str, names: set[str] | None, ns: dict) -> dict:
    """Exec the top-level classes / functions ``names`` (all when None) of ``path`` into ``ns``, lazily annotated."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=path)
    body = [n for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef))
            and (names is None or n.name in names)]
    if names is not None and {n.name for n in body} != names:
        raise ImportError(f"{path}: missing {sorted(names - {n.name for n in body})}")
    body.insert(0, ast.ImportFrom(module="__future__", names=[ast.alias("annotations")], level=0))
    exec(compile(ast.fix_missing_locations(ast.Module(body=body, type_ignores=[])), path, "exec"), ns)
    return ns


class FINISH_ABORT:  # noqa: N801 - SGLang's name
    """Stands in for SGLang's finish reason; one class for every load (the session imports it when called)."""

    def __init__(self, message: str = "") -> None:
        self.message = message


def load_sglang_session(src: str, *, npu: bool = False) -> types.SimpleNamespace:
    sg = load_sglang(src)
    srt = os.path.join(src, "sglang", "srt")

    def ceil_align(x: int, n: int) -> int:
        return -(-x // n) * n

    sb = types.ModuleType("sglang.srt.managers.schedule_batch")
    sb.__dict__.update(dataclasses=dataclasses, Optional=Optional, torch=torch, ceil_align=ceil_align,
                       FINISH_ABORT=FINISH_ABORT)
    sys.modules["sglang.srt.managers.schedule_batch"] = sb  # dataclasses look the module up while building
    _exec_classes(os.path.join(srt, "managers", "schedule_batch.py"), {"ReqKvInfo"}, sb.__dict__)

    bpc = sg.base_prefix_cache
    mod = types.ModuleType("sglang.srt.session.streaming_session")
    sys.modules[mod.__name__] = mod
    ns = mod.__dict__
    ns.update(
        logging=__import__("logging"),
        dataclass=dataclasses.dataclass, field=dataclasses.field, Any=Any, Dict=dict, Optional=Optional,
        TYPE_CHECKING=False, torch=torch, ReqKvInfo=sb.ReqKvInfo, ceil_align=ceil_align, is_npu=lambda: npu,
    )
    for n in ("BasePrefixCache", "DecLockRefParams", "DecLockRefResult", "EvictParams", "EvictResult",
              "IncLockRefResult", "InitLoadBackParams", "MatchPrefixParams", "MatchResult"):
        ns[n] = getattr(bpc, n)
    ns["logger"] = ns["logging"].getLogger("sglang_session_shim")
    _exec_classes(os.path.join(srt, "session", "streaming_session.py"), None, ns)
    return types.SimpleNamespace(
        StreamingSession=ns["StreamingSession"], SessionSlot=ns["SessionSlot"], ReqKvInfo=sb.ReqKvInfo,
        FINISH_ABORT=FINISH_ABORT, MatchPrefixParams=bpc.MatchPrefixParams, RadixKey=sg.RadixKey, sg=sg,
    )

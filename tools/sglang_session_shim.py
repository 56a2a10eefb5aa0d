"""Load SGLang's own ``StreamingSession`` (``srt/session/streaming_session.py``) on the CPU.

    from tools.sglang_session_shim import load_sglang_session
    ss = load_sglang_session("/tmp/sgl/src", npu=False)
    session = ss.StreamingSession(inner)          # any object with SGLang's cache surface

The session module is executed from SGLang's file through :mod:`tools.sglang_loader`,
which gives it SGLang's ``ReqKvInfo`` (lifted from ``managers/schedule_batch.py``) and a
``FINISH_ABORT`` class.  ``npu`` sets what ``is_npu()`` answers (the page-aligned reuse
path).  Nothing is copied into this repository.
"""

from __future__ import annotations

import importlib
import types

from tools.sglang_loader import FINISH_ABORT, load_sglang

__all__ = ["load_sglang_session"]

REAL = ("sglang.srt.session.streaming_session",)


def load_sglang_session(src: str, *, npu: bool = False) -> types.SimpleNamespace:
    sg = load_sglang(src, real=REAL)
    mod = importlib.import_module("sglang.srt.session.streaming_session")
    mod.is_npu = lambda: npu  # type: ignore[attr-defined]
    return types.SimpleNamespace(
        StreamingSession=mod.StreamingSession, SessionSlot=mod.SessionSlot, ReqKvInfo=sg.ReqKvInfo,
        FINISH_ABORT=FINISH_ABORT, MatchPrefixParams=sg.MatchPrefixParams, RadixKey=sg.RadixKey, sg=sg,
    )

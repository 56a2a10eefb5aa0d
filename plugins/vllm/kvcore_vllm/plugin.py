"""vLLM's general-plugin entry point: registers ``KvcoreOffloadingSpec`` with vLLM's spec factory.

vLLM calls it in every process it starts (``vllm.general_plugins``), before any
connector is built; calling it again is harmless.  Nothing heavy is imported.
"""

from __future__ import annotations

__all__ = ["SPEC_NAME", "register"]

SPEC_NAME = "KvcoreOffloadingSpec"

# vLLM's factory refuses a name registered twice and has no public lookup: this process remembers instead.
_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # type: ignore[import-not-found,unused-ignore]

    OffloadingSpecFactory.register_spec(SPEC_NAME, "kvcore_vllm.spec", "KvcoreOffloadingSpec")
    _registered = True

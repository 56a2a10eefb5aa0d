"""vLLM's general-plugin entry point: registers ``KvcoreOffloadingSpec`` with vLLM's spec factory.

vLLM calls it in every process it starts (``vllm.general_plugins``), before any
connector is built; calling it again is harmless.  Nothing heavy is imported.
"""

from __future__ import annotations

__all__ = ["SPEC_NAME", "register"]

SPEC_NAME = "KvcoreOffloadingSpec"


def register() -> None:
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # type: ignore[import-not-found,unused-ignore]

    if SPEC_NAME not in OffloadingSpecFactory._registry:
        OffloadingSpecFactory.register_spec(SPEC_NAME, "kvcore_vllm.spec", "KvcoreOffloadingSpec")

"""kvcore inside vLLM: ``KvcoreOffloadingSpec``, an ``OffloadingSpec`` for vLLM's ``OffloadingConnector``.

Select it with ``"kv_connector_extra_config": {"spec_name": "KvcoreOffloadingSpec",
"store": URL}`` (the ``vllm.general_plugins`` entry point registers the name), or
with ``"spec_module_path": "kvcore_vllm"``.  Importing this package does not import
vLLM; the spec is loaded on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvcore_vllm.config import KvcoreVllmConfig, parse_extra_config

if TYPE_CHECKING:
    from kvcore_vllm.spec import KvcoreOffloadingSpec

__all__ = ["KvcoreOffloadingSpec", "KvcoreVllmConfig", "parse_extra_config"]


def __getattr__(name: str) -> Any:
    # vLLM's factory does getattr(import_module(spec_module_path), spec_name).
    if name == "KvcoreOffloadingSpec":
        from kvcore_vllm.spec import KvcoreOffloadingSpec

        return KvcoreOffloadingSpec
    raise AttributeError(f"module 'kvcore_vllm' has no attribute {name!r}")

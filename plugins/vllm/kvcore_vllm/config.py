"""The options of ``kv_connector_extra_config`` that kvcore-vllm reads, validated before an engine starts."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

__all__ = ["KvcoreVllmConfig", "VLLM_OWNED_KEYS", "parse_extra_config"]

#: Keys of ``kv_connector_extra_config`` that vLLM's OffloadingConnector reads itself; passed through.
VLLM_OWNED_KEYS = frozenset({
    "spec_name", "spec_module_path", "block_size", "blocks_per_chunk", "offload_prompt_only",
    "self_describing_kv_events",
})


class KvcoreVllmConfig(BaseModel):
    """kvcore-vllm's keys of ``kv_connector_extra_config`` (see the plugin's README for each one)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    store: str | None = Field(
        None, description="a kvcore store URL (memory://, file:///dir, redis://host:port/0, "
        "redis+cluster://host:port,...); blocks found there are loaded, blocks vLLM offloads are written there. "
        "None: the host tier only")
    host_bytes: int = Field(
        1 << 30, ge=1, strict=True, description="bytes of host memory for the host tier (a shared-memory file); "
        "it holds host_bytes // block_bytes blocks, at least one")
    eviction_policy: str = Field("lru", description="the host tier's eviction order: a name from kvcore's policy "
                                 "registry (lru, lfu, fifo, mru, filo, priority, slru or a plugin's)")
    namespace: str = Field("", description="a name added to every store key, so deployments that must not share "
                           "blocks (two tenants on one Redis) never do; the model, dtype, KV layout, block size, "
                           "rank and vLLM's block-hash seed are always part of the key")
    write_to_store: bool = Field(True, description="write offloaded blocks to the store (False: read only)")
    max_fetch_blocks: int = Field(4096, ge=1, strict=True, description="blocks one background store read may ask "
                                  "for; lookups past it answer a miss for that step")
    read_wait_ms: float = Field(20.0, ge=0, le=10_000, description="how long the scheduler waits, at the end of "
                                "a step, for the store read it just started: a read back by then is loadable in the "
                                "next step; a slower one is picked up later without blocking (0: never wait)")
    verify_values: bool = Field(True, description="check each value's length and checksum when it is read. "
                                "False exists only for tests that prove loaded bytes reach the model; never use it "
                                "in a deployment")

    @field_validator("store")
    @classmethod
    def _known_scheme(cls, url: str | None) -> str | None:
        if url is None:
            return None
        from kvcore.stores.registry import StoreURL, available_stores

        scheme = StoreURL.parse(url).scheme
        known = available_stores()
        if scheme not in known:
            wants_redis = scheme in ("redis", "redis+cluster")
            hint = " (install kvcore-redis for redis:// and redis+cluster://)" if wants_redis else ""
            raise ValueError(f"no kvcore store for scheme {scheme + '://'!r}{hint}; "
                             f"known: {', '.join(s + '://' for s in sorted(known))}")
        return url

    @field_validator("eviction_policy")
    @classmethod
    def _known_policy(cls, name: str) -> str:
        from kvcore.tree.policies import resolve_policy

        resolve_policy(name)  # raises ValueError naming every known policy
        return name.lower()


def parse_extra_config(extra: Mapping[str, Any]) -> KvcoreVllmConfig:
    """kvcore's keys of ``extra`` validated; a bad one raises ValueError that names it and says what to do."""
    ours = {k: v for k, v in extra.items() if k not in VLLM_OWNED_KEYS}
    try:
        return KvcoreVllmConfig(**ours)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            field = ".".join(str(p) for p in err["loc"]) or "kv_connector_extra_config"
            msg = err["msg"]
            if err["type"] == "extra_forbidden":
                msg = ("unknown key; kvcore-vllm takes " + ", ".join(sorted(KvcoreVllmConfig.model_fields))
                       + " (and vLLM's own " + ", ".join(sorted(VLLM_OWNED_KEYS)) + ")")
            lines.append(f"  {field}: {msg}")
        raise ValueError("kvcore-vllm: bad kv_connector_extra_config:\n" + "\n".join(lines)) from None

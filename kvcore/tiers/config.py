"""The tier options a tree backend's config gains: ``host_size``, ``store`` and the host write policy."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from kvcore.config import TreeCacheConfig

__all__ = ["HOST_WRITE_POLICIES", "HostWritePolicy", "TieredCacheConfig"]

#: SGLang HiCache's ``--hicache-write-policy`` values, with SGLang's meaning.
HostWritePolicy = Literal["write_through", "write_through_selective", "write_back"]
HOST_WRITE_POLICIES: tuple[str, ...] = ("write_through", "write_through_selective", "write_back")
# SGLang's HiRadixCache: write_through_threshold = 1 for write_through, else 2.
_SELECTIVE_THRESHOLD = 2


class TieredCacheConfig(TreeCacheConfig):
    """Tree options plus a host tier (``host_size`` token slots, a ``host`` pool) and a ``store`` URL.

    Both need ``kv_buffer``: the tiers hold the K/V bytes of pages, so there must
    be bytes to hold.  ``host_write_policy`` says when a device page is copied to
    the host tier (and queued for the store), as SGLang's HiCache does:
    ``write_through`` when a request caches it, ``write_through_selective`` once
    ``host_write_threshold`` requests cached it, ``write_back`` when the device
    tree evicts it.
    """

    host_size: int = Field(0, ge=0, strict=True, description="token slots of the host tier (0: none); "
                           "finished pages are written to it per host_write_policy and matched after the device tree")
    store: str | None = Field(None, description="a KV store URL (memory://, file:///dir, redis://host:port/0, ...) "
                              "matched after the host tier and written in the background of a step")
    store_layout: str = Field("", description="the model's name in store keys (engines of one model share pages; "
                              "the K/V shape, dtype and page size are always part of the key)")
    host_write_policy: HostWritePolicy = Field(
        "write_through", description="when device pages go to the host tier and the store (SGLang's "
        "--hicache-write-policy): write_through (every cached page), write_through_selective (a page cached by "
        "host_write_threshold requests), write_back (a page the device tree evicts)")
    host_write_threshold: int = Field(
        _SELECTIVE_THRESHOLD, ge=1, strict=True, description="write_through_selective only: requests that must "
        "cache a page before it is written (SGLang's write_through_threshold, 2)")

    @field_validator("store")
    @classmethod
    def _check_store(cls, url: str | None) -> str | None:
        if url is None:
            return None
        from kvcore.stores.registry import StoreURL, available_stores

        scheme = StoreURL.parse(url).scheme
        known = available_stores()
        if scheme not in known:
            raise ValueError(f"no store for scheme {scheme + '://'!r}; known: {', '.join(s + '://' for s in known)}")
        return url

    @model_validator(mode="after")
    def _check_tiers(self) -> TieredCacheConfig:
        if self.host_size % self.page_size:
            raise ValueError(f"host_size={self.host_size} is not a multiple of page_size={self.page_size}")
        if (self.host_size or self.store) and self.kv_buffer is None:
            raise ValueError("host_size and store move K/V bytes: give kv_buffer too (e.g. kv_buffer={})")
        if self.host_write_policy != "write_through" and not self.tiers_enabled():
            raise ValueError(f"host_write_policy={self.host_write_policy!r} needs a tier to write to: "
                             "give host_size or store")
        if "host_write_threshold" in self.model_fields_set and self.host_write_policy != "write_through_selective":
            raise ValueError(f"host_write_threshold applies to host_write_policy='write_through_selective' only, "
                             f"not {self.host_write_policy!r}")
        return self

    def tiers_enabled(self) -> bool:
        return bool(self.host_size or self.store)

    def write_threshold(self) -> int:
        """Requests that must cache a page before it is written (0: only on eviction, write_back)."""
        return {"write_through": 1, "write_back": 0}.get(self.host_write_policy, self.host_write_threshold)

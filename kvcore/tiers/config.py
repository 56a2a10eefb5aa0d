"""The tier options a tree backend's config gains: ``host_size`` and ``store``."""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from kvcore.config import TreeCacheConfig

__all__ = ["TieredCacheConfig"]


class TieredCacheConfig(TreeCacheConfig):
    """Tree options plus a host tier (``host_size`` token slots, a ``host`` pool) and a ``store`` URL.

    Both need ``kv_buffer``: the tiers hold the K/V bytes of pages, so there must
    be bytes to hold.
    """

    host_size: int = Field(0, ge=0, strict=True, description="token slots of the host tier (0: none); "
                           "finished pages are written through to it and matched after the device tree")
    store: str | None = Field(None, description="a KV store URL (memory://, file:///dir, redis://host:port/0, ...) "
                              "matched after the host tier and written through in the background of a step")
    store_layout: str = Field("", description="the model's name in store keys (engines of one model share pages; "
                              "the K/V shape, dtype and page size are always part of the key)")

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
        return self

    def tiers_enabled(self) -> bool:
        return bool(self.host_size or self.store)

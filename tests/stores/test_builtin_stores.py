"""The built-in stores (memory://, file:///dir) pass the store kit; the registry's errors."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import kvcore
from kvcore.stores import FileStore, StoreConfigError, StoreNotFound
from kvcore.testing.stores import StoreConformance


class TestMemoryStore(StoreConformance):
    store_url = "memory://"


class TestNamedMemoryStore(StoreConformance):
    store_url = "memory://kit-shared"


class TestFileStore(StoreConformance):
    can_go_away = True

    @pytest.fixture
    def store_url(self, tmp_path: Path) -> str:
        return f"file://{tmp_path / 'store'}"

    def corrupt(self, store, key, data):
        assert isinstance(store, FileStore)
        p = store.path_of(key)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)

    def break_store(self, store):
        # A regular file where the directory was: every read and write fails (not merely misses).
        shutil.rmtree(store.root)
        store.root.write_bytes(b"not a directory")

    def restore_store(self, store):
        store.root.unlink()


def test_memory_store_is_bounded_by_max_bytes():
    s = kvcore.open_store("memory://?max_bytes=3000")
    keys = [f"k{i}" for i in range(5)]
    assert s.batch_set(keys, [b"x" * 1000] * 5) == [True] * 5
    got = s.batch_get(keys)
    assert got[:3] == [None, None, None] and got[3:] == [b"x" * 1000] * 2
    assert s.batch_set(["big"], [b"y" * 4000]) == [False]


def test_named_memory_stores_share_values():
    a, b = kvcore.open_store("memory://shared-by-name"), kvcore.open_store("memory://shared-by-name")
    a.batch_set(["k"], [b"v"])
    assert b.batch_get(["k"]) == [b"v"]
    assert kvcore.open_store("memory://").batch_get(["k"]) == [None]


def test_registry_lists_builtin_schemes():
    stores = kvcore.available_stores()
    assert {"memory", "file"} <= set(stores)
    assert stores["memory"].distribution == "kvcore"


@pytest.mark.parametrize(
    ("url", "error", "match"),
    [
        ("nowhere", StoreConfigError, "no scheme"),
        ("gopher://x", StoreNotFound, "known: .*memory://"),
        ("memory://?max_bytes=-1", StoreConfigError, "max_bytes"),
        ("memory://?colour=red", StoreConfigError, "unknown option 'colour'"),
        ("memory://?ttl=1&ttl=2", StoreConfigError, "twice"),
        ("file://", StoreConfigError, "needs a directory"),
        ("file://host/dir", StoreConfigError, "local"),
    ],
)
def test_bad_urls_name_what_is_wrong(url, error, match):
    with pytest.raises(error, match=match):
        kvcore.open_store(url)


def test_a_scheme_two_plugins_register_is_refused_naming_both(tmp_path, monkeypatch):
    """Stores follow the registrar's one rule (kvcore.plugins.Kind), as every other kind does."""
    from kvcore.plugins import plugin_failures, reset_plugins
    from kvcore.stores.registry import available_stores, store_failures
    from kvcore.testing.distributions import make_dist

    make_dist(tmp_path, "one-kv", "store_one", """
        import kvcore
        @kvcore.hookimpl
        def kvcore_register_stores(register):
            register("dup", lambda url: None, description="one")
            register("only-one", lambda url: None)
    """)
    make_dist(tmp_path, "two-kv", "store_two", """
        import kvcore
        @kvcore.hookimpl
        def kvcore_register_stores(register):
            register("dup", lambda url: None, description="two")
    """)
    make_dist(tmp_path, "broken-kv", "store_broken", """
        import kvcore
        @kvcore.hookimpl
        def kvcore_register_stores(register):
            register("Bad://", lambda url: None)
    """)
    monkeypatch.syspath_prepend(str(tmp_path))
    reset_plugins()
    try:
        found = available_stores()
        assert "only-one" in found and "dup" not in found and {"memory", "file"} <= set(found)
        errors = [f"{f.distribution}: {f.error}" for f in store_failures()]
        assert any("'dup' is registered by both one-kv" in e and "two-kv" in e for e in errors), errors
        assert any(e.startswith("broken-kv:") and "lower-case" in e for e in errors), errors
        assert {f.distribution for f in plugin_failures()} >= {"one-kv", "two-kv", "broken-kv"}
        with pytest.raises(StoreNotFound, match=r"'dup' is registered by both .* \(in 'dup://x'\)"):
            kvcore.open_store("dup://x")
    finally:
        reset_plugins()

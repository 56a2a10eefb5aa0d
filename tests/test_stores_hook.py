"""``kvcore_register_stores``: the built-in schemes and an installed plugin's arrive through the hook."""

import kvcore
from kvcore.plugins import get_plugin_manager


def test_hook_kvcore_register_stores():
    impls = {i.plugin_name for i in get_plugin_manager().hook.kvcore_register_stores.get_hookimpls()}
    assert "kvcore.stores.builtin" in impls
    stores = kvcore.available_stores()
    assert stores["memory"].distribution == stores["file"].distribution == "kvcore"
    if "redis" in impls:  # kvcore-redis installed (./dev setup installs every plugin folder)
        assert stores["redis"].distribution == stores["redis+cluster"].distribution == "kvcore-redis"
    store = kvcore.open_store("memory://")
    assert store.batch_set(["k"], [b"v"]) == [True] and store.batch_get(["k"]) == [b"v"]

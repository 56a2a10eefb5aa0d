import pytest


@pytest.fixture(autouse=True)
def _fresh_plugin_state():
    """Each test sees plugins loaded from the environment it sets up."""
    from kvcore.plugins import reset_plugins

    reset_plugins()
    yield
    reset_plugins()

"""kvcore-example-backend: the backend of kvcore's author guide (docs/writing-a-backend.md)."""

from kvcore_example.cache import ExampleCache, ExampleConfig, ExampleNode

__all__ = ["ExampleCache", "ExampleConfig", "ExampleNode"]

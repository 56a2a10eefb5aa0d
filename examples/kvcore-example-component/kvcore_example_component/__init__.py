"""kvcore-example-component: the component example of kvcore's author guide (docs/writing-a-backend.md)."""

from kvcore_example_component.component import StampComponent, StampOptions
from kvcore_example_component.config import ExampleComponentConfig

__all__ = ["ExampleComponentConfig", "StampComponent", "StampOptions"]

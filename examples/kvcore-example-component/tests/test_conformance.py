"""kvcore's conformance kit on the example-component backend: every scenario, the state machine and the fuzz run.

With the ``stamp`` component a match ends only where an insert ended (a request
boundary), so it runs the kit's stateful variant, as kvcore-mamba does: a hit
reaches the deepest stamped node of the path.
"""

from kvcore.testing.stateful import StatefulMatchConformance


class TestExampleComponentConformance(StatefulMatchConformance):
    backend = "example-component"

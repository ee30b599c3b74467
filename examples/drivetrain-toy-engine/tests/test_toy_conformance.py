"""The toy engine passes drivetrain's conformance kit: the whole test suite of a third-party backend."""

from drivetrain_engine_core.testing.conformance import EngineConformanceTests


class TestToyEngineConformance(EngineConformanceTests):
    """Built through the plugin registry (``create_engine``) from the ``toy`` entry point."""

    backend = "toy"  # what it offers beyond the required hooks comes from ToyEngine.capabilities

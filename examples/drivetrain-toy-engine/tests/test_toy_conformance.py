"""The toy engine passes drivetrain's conformance kit: the whole test suite of a third-party backend."""

from drivetrain_engine_core.testing.conformance import EngineConformanceTests


class TestToyEngineConformance(EngineConformanceTests):
    """Built through the plugin registry (``create_engine``) from the ``toy`` entry point."""

    backend = "toy"
    supports_value_model = False
    supports_lora = False
    low_precision_dtypes = ()  # float32 only: the config refuses another param_dtype

"""The FSDP engine passes core's engine conformance kit (built through the plugin registry)."""

from typing import Any, ClassVar

from drivetrain_engine_core.testing.conformance import EngineConformanceTests


class TestFSDPEngineConformance(EngineConformanceTests):
    backend = "fsdp"


class TestFSDPEngineConformanceLlama(EngineConformanceTests):
    backend = "fsdp"
    arch = "llama"
    engine_options: ClassVar[dict[str, Any]] = {"entropy_chunk_size": 7, "reshard_after_forward": False}

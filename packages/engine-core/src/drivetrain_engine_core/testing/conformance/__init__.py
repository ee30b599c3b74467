"""``EngineConformanceTests``: the test class every engine backend subclasses to prove it keeps the contract.

Modelled on LangChain's standard-tests: a backend's test file holds a few-line subclass naming its backend
(and, if needed, how to build an engine), and inherits every check. Each check compares the engine with an
independent single-process Hugging Face reference (:mod:`..reference`), never with itself alone. Which optional
checks run is read from the engine class's ``capabilities`` (:class:`~drivetrain_engine_core.backend.
BackendCapabilities`), the same declaration ``create_engine`` enforces: a declared capability is checked
against the reference, an undeclared one must be refused at set-up.

Example::

    from drivetrain_engine_core.testing.conformance import EngineConformanceTests

    class TestMyEngineConformance(EngineConformanceTests):
        backend = "mine"              # built through the plugin registry with create_engine
"""

from __future__ import annotations

from .base import MICRO_BATCHINGS, OPTIMIZER, PROMPT_LENGTHS, RESPONSE_LENGTHS, ConformanceBase, outputs_of
from .capability_checks import CapabilityChecks
from .core_checks import CoreChecks


class EngineConformanceTests(CoreChecks, CapabilityChecks):
    """Checks every engine must pass; subclass it in a ``Test*`` class of the backend's test suite.

    Class attributes configure the run (see :class:`~.base.ConformanceBase`); ``skip_tests`` names inherited
    tests that make no sense for a backend.
    """


__all__ = [
    "MICRO_BATCHINGS",
    "OPTIMIZER",
    "PROMPT_LENGTHS",
    "RESPONSE_LENGTHS",
    "CapabilityChecks",
    "ConformanceBase",
    "CoreChecks",
    "EngineConformanceTests",
    "outputs_of",
]

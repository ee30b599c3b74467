"""The base of the conformance kit: what a backend's test class configures, the fixtures, and the helpers the
checks share (engines built through the registry, batches, comparisons with the reference)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from tensordict import TensorDict

from drivetrain_engine_core._capabilities import BackendCapabilities
from drivetrain_engine_core._config import LoraConfig, MicroBatchConfig, ModelConfig, OptimizerConfig
from drivetrain_engine_core._engine import Engine
from drivetrain_engine_core._factory import create_engine, engine_config_from_dict
from drivetrain_engine_core._outputs import ForwardBackwardOutput
from drivetrain_engine_core._plugins import plugins
from drivetrain_engine_core.testing.batches import random_batch
from drivetrain_engine_core.testing.kit import KitBase
from drivetrain_engine_core.testing.models import make_tiny_model_dir

PROMPT_LENGTHS = (3, 5, 2, 6)
RESPONSE_LENGTHS = (5, 2, 7, 3)
OPTIMIZER = OptimizerConfig(
    lr=1e-2,
    weight_decay=0.01,
    clip_grad=1.0,
    warmup_steps=2,
    lr_schedule="cosine",
    total_steps=6,
    min_lr_ratio=0.1,
)
MICRO_BATCHINGS = {
    "fixed-1": MicroBatchConfig(micro_batch_size=1),
    "fixed-all": MicroBatchConfig(micro_batch_size=len(PROMPT_LENGTHS)),
    "dynamic-16-tokens": MicroBatchConfig(micro_batch_size=None, max_tokens=16),
}


def outputs_of(result: ForwardBackwardOutput) -> TensorDict:
    """The per-token outputs of a single-process call (the only rank is the output rank)."""
    if result.outputs is None:
        raise AssertionError("the engine returned no outputs on its output rank (is_output_rank is true)")
    return result.outputs


def flat(value: torch.Tensor) -> torch.Tensor:
    return value.values().detach().cpu()


class ConformanceBase(KitBase):
    """Configuration, fixtures and helpers of the conformance checks (see :class:`EngineConformanceTests`).

    Class attributes configure the run; override :meth:`engine_factory` (and :meth:`engine_class`) when
    ``create_engine`` with ``backend`` and ``engine_options`` cannot build the engine. What the backend offers
    beyond the required hooks is read from its class's ``capabilities``, never declared here.
    """

    backend: ClassVar[str] = ""
    """Registered backend name used by the default :meth:`engine_factory`."""
    engine_options: ClassVar[dict[str, Any]] = {}
    """Extra engine-config values (backend-specific) for the default :meth:`engine_factory`."""
    atol: ClassVar[float] = 1e-5
    rtol: ClassVar[float] = 1e-5
    curve_rtol: ClassVar[float] = 1e-4
    """Tolerance of the 5-step curve, where rounding differences compound through AdamW."""
    low_precision_rtol: ClassVar[float] = 0.01
    """How far a low-precision first step's loss and grad norm may be from the fp32 reference (relative); bf16
    compute on the tiny models measures ~1e-5 (loss) and ~1e-3 (grad norm) on CPU."""
    merge_tolerance: ClassVar[float] = 1e-6
    """``rtol`` and ``atol`` of the merged LoRA weights against the adapters folded in on the CPU, when the engine
    runs on an accelerator (its ``B @ A`` rounds differently from the CPU's); on ``cpu`` they must be equal."""

    # ------------------------------------------------------------------ hooks for subclasses
    def engine_class(self) -> type[Engine]:
        """The engine class under test, whose ``capabilities`` say which checks run (default: the class
        registered for ``backend``)."""
        if not self.backend:
            raise NotImplementedError(
                f"{type(self).__name__}: set `backend = ...` or override engine_class() and engine_factory()."
            )
        return plugins().engines.get("language_model", self.backend, self.device)

    @property
    def capabilities(self) -> BackendCapabilities:
        """What the backend declares beyond the required hooks; the checks of the rest are skipped."""
        return self.engine_class().capabilities

    def require(self, capability: str) -> None:
        """Skip the calling check unless the backend declares ``capability``."""
        if not getattr(self.capabilities, capability):
            pytest.skip(
                f"the {self.backend or 'tested'} backend does not declare the {capability!r} capability"
            )

    def engine_factory(
        self,
        model_dir: Path,
        *,
        micro_batch: MicroBatchConfig,
        lora: LoraConfig | None = None,
        optimizer_config: OptimizerConfig | None = OPTIMIZER,
        param_dtype: str = "float32",
        engine_options: dict[str, Any] | None = None,
        **model_options: Any,
    ) -> Engine:
        """Build (not initialise) the engine under test.

        Args:
            model_dir: a tiny Hugging Face model directory.
            micro_batch: the micro-batching policy to use.
            lora: adapters, when the test trains LoRA.
            optimizer_config: ``None`` for an inference-only engine.
            param_dtype: the compute dtype (``engine.param_dtype``).
            engine_options: engine-config values of this call, over the class's ``engine_options``.
            **model_options: further :class:`ModelConfig` fields (``model_type``, ``use_remove_padding``).
        """
        if not self.backend:
            raise NotImplementedError(
                f"{type(self).__name__}: set `backend = ...` or override engine_factory()."
            )
        values = {
            **self.engine_options,
            **(engine_options or {}),
            "backend": self.backend,
            "device": self.device,
            "micro_batch": micro_batch,
            "param_dtype": param_dtype,
        }
        return create_engine(
            model_config=ModelConfig(path=str(model_dir), lora=lora, **model_options),
            engine_config=engine_config_from_dict(values),
            optimizer_config=optimizer_config,
        )

    # ------------------------------------------------------------------ fixtures
    @pytest.fixture(scope="class")
    @classmethod
    def value_model_dir(cls, tmp_path_factory: pytest.TempPathFactory) -> Path:
        return make_tiny_model_dir(
            tmp_path_factory.mktemp("value_model"), arch=cls.arch, model_type="value_model"
        )

    # ------------------------------------------------------------------ helpers
    def make_engine(
        self,
        model_dir: Path,
        micro_batch: MicroBatchConfig | None = None,
        *,
        optimizer_config: OptimizerConfig | None = OPTIMIZER,
        **kwargs: Any,
    ) -> Engine:
        """An initialised engine (two sequences per micro-batch unless told otherwise)."""
        engine = self.engine_factory(
            model_dir,
            micro_batch=micro_batch or MicroBatchConfig(micro_batch_size=2),
            optimizer_config=optimizer_config,
            **kwargs,
        )
        engine.initialize()
        return engine

    @staticmethod
    def make_batch(model_dir: Path, seed: int = 0, **kwargs: Any) -> TensorDict:
        vocab_size = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
        return random_batch(
            vocab_size=vocab_size,
            prompt_lengths=PROMPT_LENGTHS,
            response_lengths=RESPONSE_LENGTHS,
            seed=seed,
            **kwargs,
        )

    def assert_close(self, actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
        torch.testing.assert_close(
            flat(actual), flat(expected), atol=self.atol, rtol=0, msg=lambda m: f"{what}: {m}"
        )

    def assert_loss_and_grad_norm(
        self, output: Any, expected: tuple[float, float], rtol: float | None = None
    ) -> None:
        rtol = self.rtol if rtol is None else rtol
        assert output.loss == pytest.approx(expected[0], rel=rtol), "loss differs from the reference"
        assert output.metrics["grad_norm"] == pytest.approx(expected[1], rel=rtol), "grad norm differs"

    @staticmethod
    def assert_speed_metrics(output: Any, batch: TensorDict) -> None:
        """Every step reports its time, tokens, tokens/s and achieved TFLOP/s (core's ``perf/*`` metrics)."""
        metrics = output.metrics
        assert metrics["perf/tokens"] >= int(batch["input_ids"].offsets()[-1]), "perf/tokens misses tokens"
        assert metrics["perf/step_time_s"] > 0 and metrics["perf/tokens_per_s"] > 0
        assert metrics.get("perf/tflops_per_device", 0) > 0, (
            "no FLOP count: override _hf_config() to return the model's transformers config"
        )

"""``EngineConformanceTests``: the test class every engine backend subclasses to prove it keeps the contract.

Modelled on LangChain's standard-tests: a backend's test file holds a ~10-line subclass naming its backend
(and, if needed, how to build an engine), and inherits every check below. Each check compares the engine
with an independent single-process Hugging Face reference (:mod:`.reference`), never with itself alone.

Example::

    from drivetrain_engine_core.testing.conformance import EngineConformanceTests

    class TestMyEngineConformance(EngineConformanceTests):
        backend = "mine"              # built through the plugin registry with create_engine
        supports_lora = False         # skip what the backend does not offer
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from tensordict import TensorDict

from drivetrain_engine_core.checkpoint import PEFT_PREFIX
from drivetrain_engine_core.config import LoraConfig, MicroBatchConfig, ModelConfig, OptimizerConfig
from drivetrain_engine_core.data.options import ForwardOptions
from drivetrain_engine_core.data.padding import nopad_to_padded, padded_to_nopad
from drivetrain_engine_core.engine import Engine
from drivetrain_engine_core.errors import BatchError, EngineStateError
from drivetrain_engine_core.factory import create_engine, engine_config_from_dict
from drivetrain_engine_core.lr_schedule import lr_at_step
from drivetrain_engine_core.outputs import ForwardBackwardOutput
from drivetrain_engine_core.testing.batches import random_batch
from drivetrain_engine_core.testing.device import device_under_test
from drivetrain_engine_core.testing.losses import token_mean_nll, value_mse
from drivetrain_engine_core.testing.models import make_tiny_model_dir
from drivetrain_engine_core.testing.reference import (
    load_reference_model,
    reference_entropy,
    reference_log_probs,
    reference_loss_and_grad_norm,
    reference_train_losses,
    reference_values,
)
from drivetrain_engine_core.testing.training import train_history

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


def _flat(value: torch.Tensor) -> torch.Tensor:
    return value.values().detach().cpu()


class EngineConformanceTests:
    """Checks every engine must pass; subclass it in a ``Test*`` class of the backend's test suite.

    Class attributes configure the run; override :meth:`engine_factory` when ``create_engine`` with
    ``backend`` and ``engine_options`` cannot build the engine.
    """

    backend: ClassVar[str] = ""
    """Registered backend name used by the default :meth:`engine_factory`."""
    device: ClassVar[str] = device_under_test()
    """``$DRIVETRAIN_TEST_DEVICE`` (``cpu`` unless the GPU lane sets ``cuda``)."""
    engine_options: ClassVar[dict[str, Any]] = {}
    """Extra engine-config values (backend-specific) for the default :meth:`engine_factory`."""
    arch: ClassVar[str] = "qwen2"
    atol: ClassVar[float] = 1e-5
    rtol: ClassVar[float] = 1e-5
    curve_rtol: ClassVar[float] = 1e-4
    """Tolerance of the 5-step curve, where rounding differences compound through AdamW."""
    supports_value_model: ClassVar[bool] = True
    supports_lora: ClassVar[bool] = True
    supports_padded_inputs: ClassVar[bool] = True
    """Whether ``ModelConfig.use_remove_padding=False`` (padded rows) is implemented."""
    low_precision_dtypes: ClassVar[tuple[str, ...]] = ("bfloat16",)
    """Compute dtypes (``engine.param_dtype``, fp32 master weights) the low-precision checks run with."""
    low_precision_rtol: ClassVar[float] = 0.01
    """How far a low-precision first step's loss and grad norm may be from the fp32 reference (relative); bf16
    compute on the tiny models measures ~1e-5 (loss) and ~1e-3 (grad norm) on CPU."""
    merge_tolerance: ClassVar[float] = 1e-6
    """``rtol`` and ``atol`` of the merged LoRA weights against the adapters folded in on the CPU, when the engine
    runs on an accelerator (its ``B @ A`` rounds differently from the CPU's); on ``cpu`` they must be equal."""
    skip_tests: ClassVar[frozenset[str]] = frozenset()
    """Names of inherited tests that make no sense for this backend."""

    # ------------------------------------------------------------------ hooks for subclasses
    def engine_factory(
        self,
        model_dir: Path,
        *,
        micro_batch: MicroBatchConfig,
        lora: LoraConfig | None = None,
        optimizer_config: OptimizerConfig | None = OPTIMIZER,
        param_dtype: str = "float32",
        **model_options: Any,
    ) -> Engine:
        """Build (not initialise) the engine under test.

        Args:
            model_dir: a tiny Hugging Face model directory.
            micro_batch: the micro-batching policy to use.
            lora: adapters, when the test trains LoRA.
            optimizer_config: ``None`` for an inference-only engine.
            param_dtype: the compute dtype (``engine.param_dtype``).
            **model_options: further :class:`ModelConfig` fields (``model_type``, ``use_remove_padding``).
        """
        if not self.backend:
            raise NotImplementedError(
                f"{type(self).__name__}: set `backend = ...` or override engine_factory()."
            )
        values = {
            **self.engine_options,
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
    @pytest.fixture(autouse=True)
    def _skip_unsupported(self, request: pytest.FixtureRequest) -> None:
        if request.function.__name__ in self.skip_tests:
            pytest.skip(f"{type(self).__name__} lists {request.function.__name__} in skip_tests")

    @pytest.fixture(scope="class")
    @classmethod
    def model_dir(cls, tmp_path_factory: pytest.TempPathFactory) -> Path:
        return make_tiny_model_dir(tmp_path_factory.mktemp("language_model"), arch=cls.arch)

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
            _flat(actual), _flat(expected), atol=self.atol, rtol=0, msg=lambda m: f"{what}: {m}"
        )

    def assert_loss_and_grad_norm(
        self, output: Any, expected: tuple[float, float], rtol: float | None = None
    ) -> None:
        rtol = self.rtol if rtol is None else rtol
        assert output.loss == pytest.approx(expected[0], rel=rtol), "loss differs from the reference"
        assert output.metrics["grad_norm"] == pytest.approx(expected[1], rel=rtol), "grad norm differs"

    # ------------------------------------------------------------------ forward
    def test_log_probs_and_entropy_match_reference(self, model_dir: Path) -> None:
        engine = self.make_engine(model_dir, optimizer_config=None)
        batch = self.make_batch(model_dir)
        options = ForwardOptions(temperature=0.7, compute_entropy=True)
        with engine.eval_mode():
            outputs = outputs_of(engine.infer_batch(batch, options=options))
        assert outputs["log_probs"].offsets().tolist() == batch["input_ids"].offsets().tolist()
        self.assert_close(
            outputs["log_probs"], reference_log_probs(model_dir, batch, temperature=0.7), "log_probs"
        )
        self.assert_close(outputs["entropy"], reference_entropy(model_dir, batch, temperature=0.7), "entropy")

    # ------------------------------------------------------------------ training
    def test_first_step_loss_and_grad_norm_match_reference(self, model_dir: Path) -> None:
        engine = self.make_engine(model_dir)
        batch = self.make_batch(model_dir)
        with engine.train_mode():
            output = engine.train_batch(batch, token_mean_nll)
        self.assert_loss_and_grad_norm(output, reference_loss_and_grad_norm(model_dir, batch, token_mean_nll))
        assert output.metrics["lr"] == pytest.approx(lr_at_step(OPTIMIZER, 0))
        self.assert_speed_metrics(output, batch)

    def test_disable_dropout_trains_as_the_eval_mode_reference(self, tmp_path: Path) -> None:
        """``model.disable_dropout``: a model whose config asks for dropout trains as the dropout-free
        reference; without it the same step differs (the control shows the dropout is live)."""
        model_dir = make_tiny_model_dir(
            tmp_path / "with_dropout", arch=self.arch, attention_dropout=0.5, hidden_dropout=0.5
        )
        batch = self.make_batch(model_dir)
        expected = reference_loss_and_grad_norm(model_dir, batch, token_mean_nll)
        outputs = {}
        for disable in (True, False):
            engine = self.make_engine(model_dir, disable_dropout=disable)
            with engine.train_mode():
                outputs[disable] = engine.train_batch(batch, token_mean_nll)
        self.assert_loss_and_grad_norm(outputs[True], expected)
        # The control must fail the same check by a clear margin (the toy engine's attention dropout moves the loss
        # by 5e-4 relative, FSDP's more).
        control = outputs[False].loss
        assert control != pytest.approx(expected[0], rel=10 * self.rtol), "the control step had no dropout"
        # Eval mode turns the model's dropout off whatever the option says: scoring (a reference policy, old
        # log-probs) must be deterministic.
        scorer = self.make_engine(model_dir, optimizer_config=None)
        with scorer.eval_mode():
            scored = outputs_of(scorer.infer_batch(batch))
        self.assert_close(scored["log_probs"], reference_log_probs(model_dir, batch), "eval-mode log_probs")

    @staticmethod
    def assert_speed_metrics(output: Any, batch: TensorDict) -> None:
        """Every step reports its time, tokens, tokens/s and achieved TFLOP/s (core's ``perf/*`` metrics)."""
        metrics = output.metrics
        assert metrics["perf/tokens"] >= int(batch["input_ids"].offsets()[-1]), "perf/tokens misses tokens"
        assert metrics["perf/step_time_s"] > 0 and metrics["perf/tokens_per_s"] > 0
        assert metrics.get("perf/tflops_per_device", 0) > 0, (
            "no FLOP count: override _hf_config() to return the model's transformers config"
        )

    @pytest.mark.parametrize("micro_batching", list(MICRO_BATCHINGS))
    def test_micro_batching_does_not_change_results(self, model_dir: Path, micro_batching: str) -> None:
        engine = self.make_engine(model_dir, MICRO_BATCHINGS[micro_batching])
        batch = self.make_batch(model_dir, seed=1)
        with engine.train_mode():
            output = engine.train_batch(batch, token_mean_nll)
        self.assert_loss_and_grad_norm(output, reference_loss_and_grad_norm(model_dir, batch, token_mean_nll))
        self.assert_close(outputs_of(output)["log_probs"], reference_log_probs(model_dir, batch), "log_probs")

    def test_five_step_training_curve_matches_reference(self, model_dir: Path) -> None:
        engine = self.make_engine(model_dir)
        batches = [self.make_batch(model_dir, seed=10 + step) for step in range(5)]
        history = train_history(engine, batches, token_mean_nll)
        expected = reference_train_losses(model_dir, batches, OPTIMIZER, token_mean_nll)
        flat_history = [value for step in history for value in step]
        assert flat_history == pytest.approx(
            [value for step in expected for value in step], rel=self.curve_rtol
        )

    def test_padded_and_no_padding_inputs_agree(self, model_dir: Path) -> None:
        original = self.make_batch(model_dir, seed=2)
        padded = nopad_to_padded(original, prompt_lengths=torch.tensor(PROMPT_LENGTHS))
        batch = padded_to_nopad(
            padded["input_ids"], padded["attention_mask"], response_mask=padded["response_mask"]
        )
        expected = reference_loss_and_grad_norm(model_dir, original, token_mean_nll)
        layouts = (True, False) if self.supports_padded_inputs else (True,)
        for use_remove_padding in layouts:
            engine = self.make_engine(model_dir, use_remove_padding=use_remove_padding)
            with engine.train_mode():
                output = engine.train_batch(batch, token_mean_nll)
            self.assert_loss_and_grad_norm(output, expected)
            self.assert_close(
                outputs_of(output)["log_probs"], reference_log_probs(model_dir, original), "log_probs"
            )

    # ------------------------------------------------------------------ checkpoints
    def test_checkpoint_round_trip_is_bit_exact(self, model_dir: Path, tmp_path: Path) -> None:
        first, second = self.make_batch(model_dir, seed=3), self.make_batch(model_dir, seed=4)
        engine = self.make_engine(model_dir)
        with engine.train_mode():
            engine.train_batch(first, token_mean_nll)
            engine.lr_scheduler_step()
        engine.save_checkpoint(tmp_path, global_step=1, extra_state={"epoch": 3})
        with engine.train_mode():
            expected = engine.train_batch(second, token_mean_nll)
        resumed = self.make_engine(model_dir)
        assert resumed.load_checkpoint(tmp_path) == {"global_step": 1, "epoch": 3}
        assert resumed.current_lr == engine.current_lr == lr_at_step(OPTIMIZER, 1)
        with resumed.train_mode():
            actual = resumed.train_batch(second, token_mean_nll)
        assert (actual.loss, actual.metrics["grad_norm"]) == (expected.loss, expected.metrics["grad_norm"])
        resumed_weights = dict(resumed.export_weights())
        for name, tensor in engine.export_weights():
            assert torch.equal(resumed_weights[name], tensor), f"{name} differs after resuming"
        assert (tmp_path / "latest").read_text().strip() == "global_step_1"

    # ------------------------------------------------------------------ errors
    def test_mode_errors_name_the_fix(self, model_dir: Path) -> None:
        engine = self.engine_factory(
            model_dir, micro_batch=MicroBatchConfig(micro_batch_size=2), optimizer_config=OPTIMIZER
        )
        batch = self.make_batch(model_dir)
        with pytest.raises(EngineStateError, match=r"initialize\(\)"), engine.train_mode():
            pass
        engine.initialize()
        with pytest.raises(EngineStateError, match="train_mode"):
            engine.train_batch(batch, token_mean_nll)
        with engine.eval_mode(), pytest.raises(EngineStateError, match="train_mode"):
            engine.train_batch(batch, token_mean_nll)
        with engine.train_mode(), pytest.raises(EngineStateError, match="loss_fn"):
            engine.forward_backward_batch(batch, None)
        batch.set_non_tensor("temprature", 0.5)
        with (
            engine.eval_mode(),
            pytest.raises(BatchError, match=r"'temprature' is not a tensor.*ForwardOptions.*'temperature'"),
        ):
            engine.infer_batch(batch)
        self.assert_bad_values_are_refused(engine, model_dir)

    def assert_bad_values_are_refused(self, engine: Engine, model_dir: Path) -> None:
        """Ids outside the tokenizer's vocabulary (also inside a padded one), too-long sequences and NaN masks
        are one ``BatchError`` naming the field and the sequence, in train and eval."""
        config = json.loads((Path(model_dir) / "config.json").read_text())
        vocab = config["vocab_size"]
        limits = engine._token_limits()
        assert limits.vocab_size is not None and limits.max_positions is not None, (
            f"{type(engine).__name__}._token_limits() returns {limits}: override it with the model's vocabulary "
            "and positions, which core checks every batch against"
        )
        batch = self.make_batch(model_dir)
        batch["input_ids"].values()[PROMPT_LENGTHS[0] + RESPONSE_LENGTHS[0] + 1] = vocab  # in sequence 1
        expected = rf"input_ids of sequence 1 holds token id {vocab}, outside \[0, {vocab}\)"
        with engine.eval_mode(), pytest.raises(BatchError, match=expected):
            engine.infer_batch(batch)
        with engine.train_mode(), pytest.raises(BatchError, match=expected):
            engine.train_batch(batch, token_mean_nll)
        longest = config["max_position_embeddings"] + 1
        too_long = random_batch(
            vocab_size=vocab, prompt_lengths=[2, longest - 4], response_lengths=[2, 4], seed=0
        )
        with (
            engine.eval_mode(),
            pytest.raises(BatchError, match=rf"sequence 1 has {longest} tokens, more than"),
        ):
            engine.infer_batch(too_long)
        batch = self.make_batch(model_dir)
        mask = batch["loss_mask"]
        values = mask.values().to(torch.float32)
        values[-1] = float("nan")
        batch["loss_mask"] = torch.nested.nested_tensor_from_jagged(values, offsets=mask.offsets())
        with (
            engine.train_mode(),
            pytest.raises(BatchError, match=r"loss_mask of sequence 3 holds 1 non-finite"),
        ):
            engine.train_batch(batch, token_mean_nll)

    # ------------------------------------------------------------------ value models
    def test_value_model_matches_reference(self, value_model_dir: Path) -> None:
        if not self.supports_value_model:
            pytest.skip(f"{type(self).__name__} does not support value models")
        engine = self.make_engine(value_model_dir, model_type="value_model")
        batch = self.make_batch(value_model_dir, with_returns=True)
        with engine.eval_mode():
            values = outputs_of(engine.infer_batch(batch))["values"]
        self.assert_close(values, reference_values(value_model_dir, batch), "values")
        with engine.train_mode():
            output = engine.train_batch(batch, value_mse)
        expected = reference_loss_and_grad_norm(value_model_dir, batch, value_mse, model_type="value_model")
        self.assert_loss_and_grad_norm(output, expected)

    # ------------------------------------------------------------------ LoRA
    def test_lora_starts_at_base_and_disable_adapter_runs_base(self, model_dir: Path) -> None:
        if not self.supports_lora:
            pytest.skip(f"{type(self).__name__} does not support LoRA")
        lora = LoraConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj"))
        engine = self.make_engine(model_dir, lora=lora)
        batch = self.make_batch(model_dir)
        base = reference_log_probs(model_dir, batch)
        with engine.eval_mode():
            self.assert_close(
                outputs_of(engine.infer_batch(batch))["log_probs"], base, "initial LoRA log_probs"
            )
        with engine.train_mode():
            engine.train_batch(batch, token_mean_nll)
        with engine.eval_mode():
            trained = outputs_of(engine.infer_batch(batch))["log_probs"]
            with engine.disable_adapter():
                disabled = outputs_of(engine.infer_batch(batch))["log_probs"]
        assert (_flat(trained) - _flat(base)).abs().max() > 100 * self.atol, "the LoRA step changed nothing"
        self.assert_close(disabled, base, "log_probs with adapters disabled")
        self.assert_adapter_hand_off(engine, model_dir, lora)

    def assert_adapter_hand_off(self, engine: Engine, model_dir: Path, lora: LoraConfig) -> None:
        """``weight_buckets(lora="adapter")`` streams exactly the PEFT adapter tensors that, folded into the
        base weights, give the merged hand-off, with the PEFT config in every bucket.

        The fold is computed on the CPU: ``base + (B.float() @ A.float()).to(dtype) * alpha / rank``. An
        engine on ``cpu`` must hand off exactly that, bit for bit. An engine on an accelerator merges there,
        and a GPU matmul (other kernels, other accumulation order) rounds differently, so there every merged
        weight must be within ``rtol = atol =`` :attr:`merge_tolerance` (1e-6) of it. On the tiny models
        (weights up to ~0.07, float32 ulp ~7e-9) the fold's rounding error measures ~4e-9, and one LoRA step
        adds ~2e-3 (mean) to a weight: the bound leaves >100 ulps of headroom yet is ~1000 times smaller than
        the adapters' contribution, so a missing, doubled or mis-scaled adapter still fails.
        """
        buckets = list(engine.weight_buckets(version=1, bucket_bytes=1024, lora="adapter"))
        adapters = {name: tensor.cpu().clone() for bucket in buckets for name, tensor in bucket.tensors()}
        config = buckets[0].adapter_config
        assert config is not None and (config["r"], config["lora_alpha"]) == (lora.rank, lora.alpha)
        assert all(b.lora == "adapter" and b.adapter_config == config for b in buckets)
        merged = {name: t.cpu().clone() for b in engine.weight_buckets(version=1) for name, t in b.tensors()}
        base = load_reference_model(model_dir).state_dict()
        adapted = {name.split(".lora_")[0] for name in adapters}
        assert len(adapters) == 2 * len(adapted) and all(
            name.split(".")[-1] in lora.target_modules for name in adapted
        ), sorted(adapters)
        for module in adapted:
            hf_name = module.removeprefix(PEFT_PREFIX) + ".weight"
            up, down = adapters[f"{module}.lora_B.weight"], adapters[f"{module}.lora_A.weight"]
            expected = base[hf_name] + (up.float() @ down.float()).to(base[hf_name].dtype) * (
                lora.alpha / lora.rank
            )
            if self.device == "cpu":
                assert torch.equal(merged[hf_name], expected), hf_name
            else:
                got, want = merged[hf_name].float(), expected.float()
                excess = float(((got - want).abs() - self.merge_tolerance * (1.0 + want.abs())).max())
                assert excess <= 0, (
                    f"merged {hf_name} (engine on {self.device}) exceeds rtol = atol = "
                    f"{self.merge_tolerance} by {excess:.1e}"
                )

    # ------------------------------------------------------------------ weight hand-off
    def test_exported_weights_are_the_models_under_their_hugging_face_names(self, model_dir: Path) -> None:
        """``export_weights()`` of a fresh float32 engine is the Hugging Face model's state dict: the same names
        and bit-equal values, each tied weight at least once. The hand-off, ``final_model`` and the merger build on
        it; the other export tests compare the engine only with itself."""
        engine = self.make_engine(model_dir, optimizer_config=None)
        exported = {name: tensor.detach().cpu() for name, tensor in engine.export_weights()}
        reference = load_reference_model(model_dir).state_dict()
        unknown = sorted(set(exported) - set(reference))
        assert not unknown, (
            f"export_weights() yields names the Hugging Face model does not have: {unknown[:3]}"
        )
        storage_of = {name: tensor.untyped_storage().data_ptr() for name, tensor in reference.items()}
        exported_storages = {storage_of[name] for name in exported}
        missing = sorted(name for name in reference if storage_of[name] not in exported_storages)
        assert not missing, f"export_weights() misses {missing[:3]}"
        for name, tensor in exported.items():
            assert tensor.dtype == reference[name].dtype and torch.equal(tensor, reference[name]), name

    def test_weight_buckets_equal_export_weights(self, model_dir: Path) -> None:
        """Buckets (of a trained engine) carry ``export_weights()`` bit for bit, each within the byte bound
        unless it is one oversized tensor, numbered and versioned; ``dtype`` casts like ``Tensor.to``; a delta
        on the untrained version, applied to it, carries the same bits."""
        engine = self.make_engine(model_dir)
        base = {n: t.cpu().clone() for b in engine.weight_buckets(version=0) for n, t in b.tensors()}
        with engine.train_mode():
            engine.train_batch(self.make_batch(model_dir), token_mean_nll)
        applied = dict(base)  # version 1 as a delta on version 0, applied to what version 0 delivered
        for delta in engine.weight_buckets(version=1, base_version=0):
            applied.update((name, tensor.cpu().clone()) for name, tensor in delta.tensors())
        exported = {name: tensor.detach().cpu().clone() for name, tensor in engine.export_weights()}
        bound = 4096
        received: dict[str, torch.Tensor] = {}
        for index, bucket in enumerate(engine.weight_buckets(version=1, bucket_bytes=bound)):
            assert (bucket.index, bucket.version) == (index, 1)
            assert bucket.nbytes <= bound or len(bucket.specs) == 1, bucket.names
            received.update((name, tensor.cpu().clone()) for name, tensor in bucket.tensors())
        assert bucket.last and list(received) == list(exported)
        for name, tensor in exported.items():
            assert received[name].dtype == tensor.dtype and torch.equal(received[name], tensor), name
            assert torch.equal(applied[name], tensor), f"delta stream: {name}"
        cast = {
            n: t.cpu() for b in engine.weight_buckets(version=2, dtype=torch.bfloat16) for n, t in b.tensors()
        }
        for name, tensor in exported.items():
            assert torch.equal(cast[name], tensor.to(torch.bfloat16)), name

    # ------------------------------------------------------------------ low precision
    @pytest.fixture(params=["bfloat16", "float16"])
    def low_precision(self, request: pytest.FixtureRequest) -> str:
        if request.param not in self.low_precision_dtypes:
            pytest.skip(f"{type(self).__name__} does not train with {request.param} compute")
        return request.param

    def test_low_precision_first_step_is_near_fp32_and_loss_falls(
        self, model_dir: Path, low_precision: str
    ) -> None:
        batch = self.make_batch(model_dir)
        engine = self.make_engine(model_dir, param_dtype=low_precision)
        losses: list[float] = []
        with engine.train_mode():
            first = engine.train_batch(batch, token_mean_nll)
            for _ in range(4):
                losses.append(engine.train_batch(batch, token_mean_nll).loss or 0.0)
                engine.lr_scheduler_step()
        expected = reference_loss_and_grad_norm(model_dir, batch, token_mean_nll)
        self.assert_loss_and_grad_norm(first, expected, rtol=self.low_precision_rtol)
        assert first.loss is not None
        assert first.loss != expected[0], (
            f"the {low_precision} step's loss is the float32 reference's to the bit: engine.param_dtype was ignored "
            "(refuse it in the engine config, and set low_precision_dtypes = () in the conformance class)"
        )
        assert losses[-1] < 0.9 * first.loss, f"{low_precision} training does not lower the loss: {losses}"

    def test_low_precision_checkpoint_round_trip_is_bit_exact(
        self, model_dir: Path, tmp_path: Path, low_precision: str
    ) -> None:
        first, second = self.make_batch(model_dir, seed=3), self.make_batch(model_dir, seed=4)
        engine = self.make_engine(model_dir, param_dtype=low_precision)
        with engine.train_mode():
            engine.train_batch(first, token_mean_nll)
        engine.save_checkpoint(tmp_path, global_step=1)
        with engine.train_mode():
            expected = engine.train_batch(second, token_mean_nll)
        resumed = self.make_engine(model_dir, param_dtype=low_precision)
        resumed.load_checkpoint(tmp_path)
        with resumed.train_mode():
            actual = resumed.train_batch(second, token_mean_nll)
        assert (actual.loss, actual.metrics["grad_norm"]) == (expected.loss, expected.metrics["grad_norm"])

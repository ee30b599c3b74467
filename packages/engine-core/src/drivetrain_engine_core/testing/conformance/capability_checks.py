"""The conformance checks of the optional capabilities (value head, LoRA, low-precision training): each runs
when the backend declares the capability, and otherwise the backend must refuse the option at set-up."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from drivetrain_engine_core._checkpoint import PEFT_PREFIX
from drivetrain_engine_core._config import ConfigError, LoraConfig, MicroBatchConfig
from drivetrain_engine_core._engine import Engine
from drivetrain_engine_core.testing.conformance.base import ConformanceBase, flat, outputs_of
from drivetrain_engine_core.testing.losses import token_mean_nll, value_mse
from drivetrain_engine_core.testing.reference import (
    load_reference_model,
    reference_log_probs,
    reference_loss_and_grad_norm,
    reference_values,
)

ASKING_FOR: dict[str, dict[str, Any]] = {
    "offload": {"engine_options": {"param_offload": True}},
    "lora": {"lora": LoraConfig(rank=4, alpha=8.0, target_modules=("q_proj",))},
    "padded_inputs": {"use_remove_padding": False},
}
"""``engine_factory`` arguments that ask for each boolean capability."""


class CapabilityChecks(ConformanceBase):
    """Checks of what a backend declares in its ``capabilities``."""

    # ------------------------------------------------------------------ value models
    def test_value_model_matches_reference(self, value_model_dir: Path) -> None:
        self.require("value_model")
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
        self.require("lora")
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
        assert (flat(trained) - flat(base)).abs().max() > 100 * self.atol, "the LoRA step changed nothing"
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

    # ------------------------------------------------------------------ low precision
    @pytest.fixture(params=["bfloat16", "float16"])
    def low_precision(self, request: pytest.FixtureRequest) -> str:
        if request.param not in self.capabilities.low_precision_train_dtypes:
            pytest.skip(
                f"the {self.backend or 'tested'} backend does not declare training in {request.param}"
            )
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
            "(leave it out of the backend's BackendCapabilities.train_dtypes)"
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

    # ------------------------------------------------------------------ undeclared capabilities
    @pytest.mark.parametrize("capability", ["offload", "lora", "padded_inputs", "param_dtypes"])
    def test_an_undeclared_capability_is_refused_at_set_up(self, model_dir: Path, capability: str) -> None:
        """A config asking for what the backend does not declare fails at set-up (``create_engine``, or
        ``initialize`` for an engine built directly), before any model is built, with one error naming the
        backend, the capability and the option."""
        capabilities = self.capabilities
        if capability == "param_dtypes":
            missing = [dtype for dtype in ("bfloat16", "float16") if dtype not in capabilities.param_dtypes]
            if not missing:
                pytest.skip("the backend computes in every dtype")
            asked: dict[str, Any] = {"param_dtype": missing[0]}
        else:
            if getattr(capabilities, capability):
                pytest.skip(f"the backend declares {capability!r}")
            asked = ASKING_FOR[capability]
        with pytest.raises(ConfigError, match=rf"{self.backend} backend.*{capability}"):
            self.engine_factory(
                model_dir, micro_batch=MicroBatchConfig(micro_batch_size=2), **asked
            ).initialize()

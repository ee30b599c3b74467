"""The conformance checks of the required hooks: forward, training, micro-batching, layouts, checkpoints,
errors, and the exported and handed-off weights (every backend runs them all)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers.core_model_loading import revert_weight_conversion

from drivetrain_engine_core._config import MicroBatchConfig
from drivetrain_engine_core._data.options import ForwardOptions
from drivetrain_engine_core._data.padding import nopad_to_padded, padded_to_nopad
from drivetrain_engine_core._engine import Engine
from drivetrain_engine_core._errors import BatchError, EngineStateError
from drivetrain_engine_core._lr_schedule import lr_at_step
from drivetrain_engine_core.testing.batches import random_batch
from drivetrain_engine_core.testing.conformance.base import (
    MICRO_BATCHINGS,
    OPTIMIZER,
    PROMPT_LENGTHS,
    RESPONSE_LENGTHS,
    ConformanceBase,
    outputs_of,
)
from drivetrain_engine_core.testing.losses import token_mean_nll
from drivetrain_engine_core.testing.models import make_tiny_model_dir
from drivetrain_engine_core.testing.reference import (
    load_reference_model,
    reference_entropy,
    reference_log_probs,
    reference_loss_and_grad_norm,
    reference_train_losses,
)
from drivetrain_engine_core.testing.training import train_history


class CoreChecks(ConformanceBase):
    """Checks of what every backend implements."""

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
        layouts = (True, False) if self.capabilities.padded_inputs else (True,)
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
        limits = engine.token_limits
        assert limits.vocab_size is not None and limits.max_positions is not None, (
            f"{type(engine).__name__}.token_limits is {limits}: override _token_limits() with the model's vocabulary "
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

    # ------------------------------------------------------------------ weight hand-off
    def test_exported_weights_are_the_models_under_their_hugging_face_names(self, model_dir: Path) -> None:
        """``export_weights()`` of a fresh float32 engine is the Hugging Face model's state dict in checkpoint
        layout (as ``save_pretrained`` writes it: a mixture-of-experts model's fused experts one tensor each): the
        same names and bit-equal values, each tied weight at least once. The hand-off, ``final_model`` and the
        merger build on it; the other export tests compare the engine only with itself."""
        engine = self.make_engine(model_dir, optimizer_config=None)
        exported = {name: tensor.detach().cpu() for name, tensor in engine.export_weights()}
        model: Any = load_reference_model(model_dir)
        # Unconverted weights come back as the same tensors, so ties still share a storage.
        reference = revert_weight_conversion(model, dict(model.state_dict()))
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

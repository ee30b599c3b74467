"""Single-process MegatronEngine in bf16 and fp16 against a float32 Hugging Face reference, and bf16 resume.

The engine runs in this process as a world of one (CPU and gloo; CUDA in the GPU lane). Mixed precision keeps float32 main weights in
megatron's optimizer: the reference is plain float32 HF training, so numbers agree within a stated
tolerance (bf16 rounds more than fp16); a resumed run must equal the uninterrupted one bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from drivetrain_engine_core.backend import CheckpointError, ModelConfig, OptimizerConfig
from drivetrain_engine_core.job import MicroBatchConfig
from drivetrain_engine_core.testing import (
    make_tiny_model_dir,
    random_batch,
    reference_train_losses,
    token_mean_nll,
    train_history,
)
from drivetrain_engine_core.testing.device import device_under_test

# The GPU machine may lack megatron-core and mbridge: the lane skips these rather than failing them.
pytest.importorskip("megatron.core")
pytest.importorskip("mbridge")

pytestmark = pytest.mark.slow

OPTIMIZER = OptimizerConfig(lr=1e-3, clip_grad=1.0, weight_decay=0.01)
# Tolerances against float32 over three steps, about 5-10x the largest difference measured here:
# grad norm relative (fp16 1.3e-4, bf16 2.0e-3), loss absolute (fp16 7.9e-5, bf16 2.0e-4).
GRAD_NORM_RTOL = {"float16": 1e-3, "bfloat16": 1e-2}
LOSS_ATOL = {"float16": 5e-4, "bfloat16": 2e-3}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("qwen2"), arch="qwen2")


def _engine(
    model_dir: Path,
    param_dtype: str,
    use_distributed_optimizer: bool = True,
    optimizer: OptimizerConfig = OPTIMIZER,
):
    from drivetrain_engine_megatron import MegatronEngine, MegatronEngineConfig

    engine = MegatronEngine(
        model_config=ModelConfig(path=str(model_dir)),
        engine_config=MegatronEngineConfig(
            device=device_under_test(),
            param_dtype=param_dtype,
            use_distributed_optimizer=use_distributed_optimizer,
            micro_batch=MicroBatchConfig(micro_batch_size=2),
        ),
        optimizer_config=optimizer,
    )
    engine.initialize()
    return engine


def _batches(model_dir: Path, seeds: range) -> list:
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    return [
        random_batch(
            vocab_size=vocab_size, prompt_lengths=[3, 5, 2, 4], response_lengths=[4, 2, 6, 3], seed=s
        )
        for s in seeds
    ]


@pytest.mark.parametrize("param_dtype", sorted(GRAD_NORM_RTOL))
def test_low_precision_training_matches_float32_reference(model_dir, param_dtype):
    """fp16 gradients are loss-scaled then unscaled (without the scale: norm ratio 2^-16), and every step updates."""
    batches = _batches(model_dir, range(3))
    engine = _engine(model_dir, param_dtype)
    history = train_history(engine, batches, token_mean_nll)
    reference = reference_train_losses(model_dir, batches, OPTIMIZER, token_mean_nll)
    assert engine.skipped_steps == 0
    for (loss, norm), (ref_loss, ref_norm) in zip(history, reference, strict=True):
        assert norm == pytest.approx(ref_norm, rel=GRAD_NORM_RTOL[param_dtype]), (history, reference)
        assert loss == pytest.approx(ref_loss, abs=LOSS_ATOL[param_dtype]), (history, reference)


@pytest.mark.parametrize(
    ("param_dtype", "use_distributed_optimizer"),
    [("bfloat16", True), ("bfloat16", False), ("float16", True)],
)
def test_low_precision_resume_is_bit_exact(model_dir, tmp_path, param_dtype, use_distributed_optimizer):
    """Save after one step, then two more steps: the resumed engine repeats them bit for bit."""
    first, *rest = _batches(model_dir, range(3))
    engine = _engine(model_dir, param_dtype, use_distributed_optimizer)
    train_history(engine, [first], token_mean_nll)
    engine.save_checkpoint(tmp_path, global_step=1)
    expected = train_history(engine, rest, token_mean_nll)
    resumed = _engine(model_dir, param_dtype, use_distributed_optimizer)
    assert resumed.load_checkpoint(tmp_path) == {"global_step": 1}
    assert train_history(resumed, rest, token_mean_nll) == expected
    resumed_weights = dict(resumed.export_weights())
    for name, tensor in engine.export_weights():
        assert torch.equal(resumed_weights[name], tensor), f"{name} differs after resuming"


def test_a_step_loaded_without_its_optimizer_state_trains_from_the_loaded_weights(model_dir, tmp_path):
    """In bf16 megatron's optimizer keeps float32 main copies of the weights, taken when it was built: loading
    a step with ``load_optimizer=False`` changed the model only, and the next step (here at lr 0) wrote the
    starting weights back over the loaded ones."""
    engine = _engine(model_dir, "bfloat16")
    train_history(engine, _batches(model_dir, range(1)), token_mean_nll)
    engine.save_checkpoint(tmp_path, global_step=1)
    saved = dict(engine.export_weights())
    fresh = _engine(model_dir, "bfloat16", optimizer=OptimizerConfig(lr=0.0, weight_decay=0.0))
    fresh.load_checkpoint(tmp_path, load_optimizer=False)
    with fresh.train_mode():
        fresh.train_batch(_batches(model_dir, range(1, 2))[0], token_mean_nll)
    for name, tensor in fresh.export_weights():
        assert torch.equal(tensor, saved[name]), f"{name} lost the loaded weights"


def test_resuming_into_a_model_of_another_shape_names_the_tensor_and_both_shapes(model_dir, tmp_path):
    """A --resume whose model.path named a wider model failed inside dist_checkpointing with a traceback."""
    _engine(model_dir, "float32").save_checkpoint(tmp_path / "ckpt", global_step=1)
    wider = make_tiny_model_dir(tmp_path / "wider", arch="qwen2", hidden_size=48)
    hidden = json.loads((model_dir / "config.json").read_text())["hidden_size"]
    # Megatron stacks layers on a leading axis: the first differing tensor is [layers, hidden], [layers, 48].
    expected = rf"holds \S+ of shape \[([\d, ]*){hidden}\], but the model being loaded has \[\1 ?48\]: the checkpoint"
    with pytest.raises(CheckpointError, match=expected):
        _engine(wider, "float32").load_checkpoint(tmp_path / "ckpt")


def test_distributed_optimizer_state_continues_on_the_plain_optimizer(model_dir, tmp_path):
    """The plain optimizer resuming a distributed-optimizer step (a layout dist_checkpointing cannot read across:
    it was refused) continues as the uninterrupted run: the Adam moments are cut out of the flat bucket tensors
    by the layout record the save writes, and the Adam step comes from it (a step count of 0 changes the second
    step's loss)."""
    batches = _batches(model_dir, range(4))
    engine = _engine(model_dir, "float32", use_distributed_optimizer=True)
    train_history(engine, batches[:2], token_mean_nll)
    engine.save_checkpoint(tmp_path, global_step=2)
    expected = train_history(engine, batches[2:], token_mean_nll)
    plain = _engine(model_dir, "float32", use_distributed_optimizer=False)
    assert plain.load_checkpoint(tmp_path) == {"global_step": 2}
    for (loss, norm), (ref_loss, ref_norm) in zip(
        train_history(plain, batches[2:], token_mean_nll), expected, strict=True
    ):
        assert loss == pytest.approx(ref_loss, rel=1e-5) and norm == pytest.approx(ref_norm, rel=1e-5)


def test_an_export_stopped_early_leaves_gradients_on(model_dir):
    """The export generator held ``torch.no_grad()`` across its yields; one closed late (a consumer that stops
    early: zip over two exports) restored the grad mode it saw when it entered, False, and every later step of
    the process built no graph ("element 0 of tensors does not require grad")."""
    engine = _engine(model_dir, "float32")
    first, second = engine.export_weights(), engine.export_weights()
    next(first), next(second), next(first)
    del first, second
    import gc

    gc.collect()
    assert torch.is_grad_enabled()


def _overflowing(model_output, batch, context):
    loss, metrics = token_mean_nll(model_output, batch, context)
    return loss * float("inf"), metrics


@pytest.mark.parametrize("use_distributed_optimizer", [True, False], ids=["distributed", "plain"])
def test_fp16_checkpoint_before_the_first_update_resumes(model_dir, tmp_path, use_distributed_optimizer):
    """Three overflowing steps are skipped and halve the loss scale (2^16 -> 2^14, hysteresis 2); a checkpoint
    of this never-updated optimizer saves, loads with its loss scale, and then resumes bit for bit."""
    *overflowing, clean = _batches(model_dir, range(4))
    engine = _engine(model_dir, "float16", use_distributed_optimizer)
    with engine.train_mode():
        for batch in overflowing:
            engine.train_batch(batch, _overflowing)
    assert engine.skipped_steps == 3
    engine.save_checkpoint(tmp_path, global_step=3)
    expected = train_history(engine, [clean, clean], token_mean_nll)
    resumed = _engine(model_dir, "float16", use_distributed_optimizer)
    resumed.load_checkpoint(tmp_path)
    # The loss scale is internal to megatron's optimizer (powers of two leave the numbers unchanged).
    assert float(resumed._optimizer.get_loss_scale()) == 2.0**14
    assert train_history(resumed, [clean, clean], token_mean_nll) == expected


MEGATRON_TRIGGERED = ("full scope is deprecated", "The .grad attribute of a Tensor that is not a leaf")


def test_build_and_float32_steps_print_no_megatron_triggered_warning(model_dir):
    """Each appeared once per engine and rank in every run's output: megatron-core's "full scope is
    deprecated" for its own ``cuda_graph_scope`` default (the bridge built the config with megatron's
    defaults first), and torch's non-leaf ``.grad`` warning from the float32 distributed optimizer's
    ``zero_grad``. Silencing changed nothing: the steps still equal float32 Hugging Face training."""
    import warnings

    batches = _batches(model_dir, range(2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = train_history(_engine(model_dir, "float32"), batches, token_mean_nll)
    assert [str(w.message) for w in caught if str(w.message).startswith(MEGATRON_TRIGGERED)] == []
    reference = reference_train_losses(model_dir, batches, OPTIMIZER, token_mean_nll)
    for (loss, norm), (ref_loss, ref_norm) in zip(history, reference, strict=True):
        assert loss == pytest.approx(ref_loss, abs=1e-5)
        assert norm == pytest.approx(ref_norm, rel=1e-4)

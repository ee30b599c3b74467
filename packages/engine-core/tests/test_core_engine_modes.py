"""Base ``Engine`` behaviour through a tiny plain-torch engine: state errors, modes, offload order, skipped
updates, the LR schedule, loss scaling and output order."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from drivetrain_engine_core._lr_schedule import lr_at_step
from drivetrain_engine_core.backend import (
    BatchError,
    ConfigError,
    EngineStateError,
    ForwardOptions,
    MicroBatch,
    ModelConfig,
    OptimizerConfig,
    RoundTrip,
)
from drivetrain_engine_core.job import DivergenceError, LossContext, MicroBatchConfig
from drivetrain_engine_core.testing.batches import random_batch
from drivetrain_engine_core.testing.losses import token_mean_nll
from drivetrain_engine_core.testing.tiny_engine import TinyEngineConfig, TinyTorchEngine
from tensordict import TensorDict

VOCAB = 64
OPTIMIZER = OptimizerConfig(lr=0.1, weight_decay=0.0, clip_grad=None)


def make_engine(
    optimizer: OptimizerConfig | None = OPTIMIZER, initialize: bool = True, **engine
) -> TinyTorchEngine:
    tiny = TinyTorchEngine(
        model_config=ModelConfig(path="tiny-model"),
        engine_config=TinyEngineConfig(vocab_size=VOCAB, **engine),
        optimizer_config=optimizer,
    )
    if initialize:
        tiny.initialize()
    return tiny


def make_batch(seed: int = 0):
    return random_batch(
        vocab_size=VOCAB, prompt_lengths=[2, 4, 1, 3], response_lengths=[3, 1, 5, 2], seed=seed
    )


def weights(engine: TinyTorchEngine) -> dict[str, torch.Tensor]:
    return dict(engine.export_weights())


# ---------------------------------------------------------------------- state errors


@pytest.mark.parametrize(
    "call",
    [
        lambda e: e.train_mode().__enter__(),
        lambda e: e.eval_mode().__enter__(),
        lambda e: e.save_checkpoint("/nonexistent", 1),
        lambda e: e.load_checkpoint("/nonexistent"),
        lambda e: e.to("cpu"),
        lambda e: next(e.export_weights()),
        lambda e: e.forward_backward_batch(make_batch(), token_mean_nll),
        lambda e: e.optimizer_step(),
    ],
)
def test_calls_before_initialize_say_to_initialize(call) -> None:
    with pytest.raises(EngineStateError, match=r"call engine\.initialize\(\) first"):
        call(make_engine(initialize=False))


def test_initialize_twice_is_an_error() -> None:
    with pytest.raises(EngineStateError, match=r"initialize\(\) was already called"):
        make_engine().initialize()


class _MispredictingConfig(TinyEngineConfig):
    def data_parallel_size(self, world_size: int) -> int:
        return 2 * world_size


def test_a_config_that_mispredicts_the_data_parallel_size_fails_initialize() -> None:
    """Trainers check batch sizes with the config's prediction before any engine exists; a backend whose
    config does not describe its layout is caught here, not by a batch split that no longer fits."""
    assert TinyEngineConfig().data_parallel_size(4) == 4
    engine = TinyTorchEngine(
        model_config=ModelConfig(path="tiny-model"), engine_config=_MispredictingConfig(vocab_size=VOCAB)
    )
    with pytest.raises(EngineStateError, match=r"built 1 data-parallel ranks on 1 ranks, but .* predicts 2"):
        engine.initialize()


def test_compute_errors_name_the_fix() -> None:
    engine, batch = make_engine(), make_batch()
    with pytest.raises(EngineStateError, match=r"wrap the call in `with engine\.train_mode"):
        engine.infer_batch(batch)
    with pytest.raises(EngineStateError, match=r"must run inside `engine\.train_mode"), engine.eval_mode():
        engine.train_batch(batch, token_mean_nll)
    with pytest.raises(EngineStateError, match="pass loss_fn="), engine.train_mode():
        engine.forward_backward_batch(batch, None)
    with (
        pytest.raises(EngineStateError, match=r"optimizer_step\(\) must be called inside"),
        engine.eval_mode(),
    ):
        engine.optimizer_step()
    with pytest.raises(EngineStateError, match=r"set model\.lora"):
        engine.disable_adapter().__enter__()
    with pytest.raises(ValueError, match=r"engine.to\('meta'\).*\['cpu'\]"):
        engine.to("meta")
    # A gradient must live on its parameter's device (FSDP assigned host gradients to GPU parameters).
    with pytest.raises(ValueError, match=r"gradients move with the model; pass model=True"):
        engine.to("cpu", model=False, grad=True)
    with pytest.raises(
        BatchError, match=r"'temprature' is not a tensor.*ForwardOptions.*Did you mean 'temperature'"
    ):
        batch.set_non_tensor("temprature", 0.5)
        with engine.eval_mode():
            engine.infer_batch(batch)


def test_inference_only_engine_refuses_training() -> None:
    engine = make_engine(optimizer=None)
    with pytest.raises(EngineStateError, match="optimizer_config=None"), engine.train_mode():
        engine.train_batch(make_batch(), token_mean_nll)
    with pytest.raises(EngineStateError, match="optimizer_config=None"):
        engine.lr_scheduler_step()


def test_loss_fn_must_return_a_scalar() -> None:
    engine = make_engine()

    def vector_loss(output, batch, context):
        return output["log_probs"].values(), {}

    with pytest.raises(TypeError, match=r"scalar tensor.*shape \(\d+,\)"), engine.train_mode():
        engine.train_batch(make_batch(), vector_loss)


# ---------------------------------------------------------------------- modes and offload order


def test_modes_are_reentrant_and_offload_only_at_the_outermost_exit() -> None:
    engine = make_engine(param_offload=True, optimizer_offload=True)
    assert engine.calls == [("offload", "params=True", "optimizer=True")]
    engine.calls.clear()
    with engine.train_mode():
        assert engine.mode == "train"
        with engine.eval_mode():
            assert engine.mode == "eval"
            with engine.eval_mode():
                assert engine.mode == "eval"
        with engine.train_mode():
            assert engine.mode == "train"
        assert engine.mode == "train"
    assert engine.mode is None
    assert engine.calls == [
        ("load", "params=True", "optimizer=True"),
        ("set_mode", "train"),
        ("set_mode", "eval"),
        ("set_mode", "train"),
        ("offload", "params=True", "optimizer=True"),
    ]
    engine.calls.clear()
    with engine.eval_mode():
        pass
    assert engine.calls == [
        ("load", "params=True", "optimizer=False"),
        ("set_mode", "eval"),
        ("offload", "params=True", "optimizer=True"),
    ]


def test_a_train_block_inside_an_eval_block_loads_the_optimizer_state() -> None:
    """Only the outermost block loaded: ``eval_mode`` loads the parameters alone, so a ``train_mode`` (or a
    checkpoint load) inside it stepped with the optimizer state still on the host."""
    engine = make_engine(param_offload=True, optimizer_offload=True)
    engine.calls.clear()
    with engine.eval_mode():
        with engine.train_mode():
            pass
        with engine.train_mode():
            pass
    assert engine.calls == [
        ("load", "params=True", "optimizer=False"),
        ("set_mode", "eval"),
        ("load", "params=False", "optimizer=True"),
        ("set_mode", "train"),
        ("set_mode", "eval"),
        ("load", "params=False", "optimizer=True"),
        ("set_mode", "train"),
        ("set_mode", "eval"),
        ("offload", "params=True", "optimizer=True"),
    ]


def test_mode_is_left_even_when_the_block_raises() -> None:
    engine = make_engine()
    with pytest.raises(RuntimeError, match="boom"), engine.train_mode():
        raise RuntimeError("boom")
    assert engine.mode is None


# ---------------------------------------------------------------------- optimizer


def test_non_finite_grad_norm_skips_the_update() -> None:
    engine, batch = make_engine(), make_batch()
    before = weights(engine)

    def nan_loss(output, micro_batch, context):
        loss, metrics = token_mean_nll(output, micro_batch, context)
        return loss * float("nan"), metrics

    with engine.train_mode():
        output = engine.train_batch(batch, nan_loss)
    assert math.isnan(output.metrics["grad_norm"])
    assert engine.skipped_steps == 1
    assert all(p.grad is None for p in engine.model.parameters())
    assert all(torch.equal(before[k], v) for k, v in weights(engine).items())
    with engine.train_mode():
        output = engine.train_batch(batch, token_mean_nll)
    assert math.isfinite(output.metrics["grad_norm"]) and engine.skipped_steps == 1
    assert not torch.equal(before["0.weight"], weights(engine)["0.weight"])


def test_malformed_batches_are_one_error_naming_the_fix() -> None:
    engine = make_engine()
    batch = make_batch()
    with (
        engine.eval_mode(),
        pytest.raises(BatchError, match=r"must be a tensordict.TensorDict, got dict.*make_batch"),
    ):
        engine.infer_batch({key: batch[key] for key in ("input_ids", "position_ids")})
    for offsets in ([0, 3, 2, 6], [1, 3, 6], [0, 3, 5]):
        ids = torch.nested.nested_tensor_from_jagged(torch.arange(6), offsets=torch.tensor(offsets))
        bad = TensorDict({"input_ids": ids, "position_ids": ids}, batch_size=[len(offsets) - 1])
        with engine.eval_mode(), pytest.raises(BatchError, match=r"input_ids has malformed offsets"):
            engine.infer_batch(bad)
    batch["input_ids"].values()[0] = -1
    with (
        engine.eval_mode(),
        pytest.raises(BatchError, match=r"sequence 0 holds token id -1, outside \[0, 64\)"),
    ):
        engine.infer_batch(batch)


def test_skipped_updates_hold_the_lr_schedule_and_too_many_in_a_row_stop_the_run() -> None:
    optimizer = OptimizerConfig(lr=1.0, warmup_steps=4, max_consecutive_skips=3)
    engine, batch = make_engine(optimizer), make_batch()

    def nan_loss(output, micro_batch, context):
        loss, metrics = token_mean_nll(output, micro_batch, context)
        return loss * float("nan"), metrics

    def step(loss_fn) -> float:
        with engine.train_mode():
            engine.train_batch(batch, loss_fn)
        return engine.lr_scheduler_step()

    assert step(token_mean_nll) == pytest.approx(0.5)  # warm-up 1 -> 2 of 4
    assert [step(nan_loss), step(nan_loss)] == pytest.approx([0.5, 0.5])  # skipped: the schedule holds
    assert step(token_mean_nll) == pytest.approx(0.75)
    assert engine.skipped_steps == 2
    step(nan_loss)
    step(nan_loss)
    with pytest.raises(
        DivergenceError,
        match=r"3 optimizer updates in a row had a non-finite grad norm .*max_consecutive_skips",
    ):
        step(nan_loss)
    assert engine.skipped_steps == 5


def test_lr_schedule_warmup_then_linear_decay_by_hand() -> None:
    """The Hugging Face Trainer's and TRL's default schedule: linear warm-up, then a straight line to the floor."""
    config = OptimizerConfig(lr=1.0, warmup_steps=2, lr_schedule="linear", total_steps=6, min_lr_ratio=0.2)
    expected = [0.5, 1.0, 1.0, 0.8, 0.6, 0.4, 0.2, 0.2]  # steps 0..7; the floor holds after total_steps
    assert [lr_at_step(config, s) for s in range(8)] == pytest.approx(expected)
    with pytest.raises(ConfigError, match=r"lr_schedule='linear' needs optimizer\.total_steps greater"):
        OptimizerConfig(lr_schedule="linear", warmup_steps=5, total_steps=5)


def test_lr_schedule_warmup_then_cosine_by_hand() -> None:
    config = OptimizerConfig(lr=1.0, warmup_steps=2, lr_schedule="cosine", total_steps=6, min_lr_ratio=0.1)
    cosine = [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * k / 4)) for k in range(5)]
    expected = [0.5, 1.0, *cosine, 0.1, 0.1]  # steps 0..8; the floor holds after total_steps
    assert [lr_at_step(config, s) for s in range(9)] == pytest.approx(expected)
    assert cosine[0] == pytest.approx(1.0) and cosine[2] == pytest.approx(0.55)
    engine = make_engine(optimizer=config)
    seen = [engine.current_lr]
    with engine.train_mode():
        for _ in range(8):
            output = engine.train_batch(make_batch(), token_mean_nll)
            assert output.metrics["lr"] == engine.optimizer.param_groups[0]["lr"] == seen[-1]
            seen.append(engine.lr_scheduler_step())
    assert seen == pytest.approx(expected)


def test_constant_schedule_holds_after_warmup() -> None:
    config = OptimizerConfig(lr=0.3, warmup_steps=3)
    assert [lr_at_step(config, s) for s in range(5)] == pytest.approx([0.1, 0.2, 0.3, 0.3, 0.3])


# ---------------------------------------------------------------------- loss scaling and outputs


@pytest.mark.parametrize("divisor", [4, 1])
def test_finish_scales_the_loss_by_the_gradient_divisor_only(divisor: int) -> None:
    context = LossContext(global_token_count=8, global_sequence_count=2)
    trip = RoundTrip(
        loss_fn=lambda output, batch, ctx: (torch.tensor(0.75), {"seen_tokens": ctx.global_token_count}),
        options=ForwardOptions(),
        context=context,
        gradient_divisor=divisor,
        keep_outputs=False,
    )
    micro_batch = MicroBatch.build(make_batch(), 1, device="cpu", layout="packed", round_trip=trip)
    scaled, result = micro_batch.finish({"log_probs": torch.zeros(micro_batch.num_tokens)})
    assert float(scaled) == 0.75 * divisor and float(result.loss) == 0.75
    assert result.metrics == {"seen_tokens": 8.0} and result.outputs is None
    assert micro_batch.context.micro_batch_index == 1


def hand_log_probs(engine: TinyTorchEngine, batch, temperature: float = 1.0) -> list[torch.Tensor]:
    """log p(token i | previous) of the tiny model, one sequence at a time: 0 at i = 0."""
    result = []
    offsets = batch["input_ids"].offsets().tolist()
    for start, end in itertools.pairwise(offsets):
        ids = batch["input_ids"].values()[start:end]
        with torch.no_grad():
            logp = torch.log_softmax(engine.model(ids) / temperature, dim=-1)
        result.append(torch.cat([torch.zeros(1), logp[:-1].gather(-1, ids[1:, None]).squeeze(-1)]))
    return result


@pytest.mark.parametrize(
    ("micro_batch", "count"),
    [
        (MicroBatchConfig(micro_batch_size=3), 2),
        (MicroBatchConfig(micro_batch_size=None, max_tokens=7), 4),  # lengths 5, 5, 6, 5: one per micro-batch
        (MicroBatchConfig(micro_batch_size=None, max_tokens=11), 2),  # {5, 6} and {5, 5}, reordered
    ],
)
def test_outputs_come_back_in_sample_order_with_global_loss(
    micro_batch: MicroBatchConfig, count: int
) -> None:
    engine = make_engine(micro_batch=micro_batch)
    batch = make_batch(seed=5)
    with engine.eval_mode():
        output = engine.infer_batch(batch, token_mean_nll, options=ForwardOptions(temperature=0.5))
    expected = hand_log_probs(engine, batch, temperature=0.5)
    assert output.outputs["log_probs"].offsets() is batch["input_ids"].offsets()
    for got, want in zip(output.outputs["log_probs"].unbind(), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    mask = batch["loss_mask"].values()
    expected_loss = -(torch.cat(expected) * mask).sum() / mask.sum()
    assert output.loss == pytest.approx(float(expected_loss), rel=1e-6)
    assert len(output.metrics["nll_sum"]) == count

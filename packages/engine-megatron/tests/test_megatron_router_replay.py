"""Router replay (R3) on the Megatron engine, one rank, the tiny Qwen3-MoE (4 experts, top-2), fp32, against
plain Hugging Face (``drivetrain_engine_core.testing.routing``'s references, written out on the HF model):

- routes that are the live ones (a plain HF forward's top-k) change no log-prob (packed and padded rows);
- routes chosen by a formula, unlike the live ones, give a plain HF forward forced to them (1e-5), which the
  engine without the record does not;
- what it refuses, naming the option: another model's record, sequence parallelism, a dense model.

Expert parallelism (2 ranks) and agreement with the FSDP engine's replay: the root
``tests/test_moe_across_backends.py``.
"""

from __future__ import annotations

import pytest
import torch
from drivetrain_engine_core.backend import (
    BatchError,
    ForwardOptions,
    MicroBatch,
    ModelConfig,
    OptimizerConfig,
    RoundTrip,
)
from drivetrain_engine_core.job import LossContext, MicroBatchConfig
from drivetrain_engine_core.kit import NOT_RECORDED
from drivetrain_engine_core.testing import (
    forced_log_probs,
    formula_routes,
    load_reference_model,
    make_tiny_model_dir,
    plain_hf_top_k,
    random_batch,
    token_mean_nll,
    train_history,
    with_routes,
)
from drivetrain_engine_core.testing.device import requires_cuda

pytestmark = pytest.mark.slow
TOP_K, EXPERTS, LAYERS = 2, 4, 2
OPTIMIZER = OptimizerConfig(lr=1e-2, clip_grad=1.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("moe"), arch="qwen3_moe")


@pytest.fixture(scope="module")
def batch():
    return random_batch(vocab_size=100, prompt_lengths=[3, 5, 2, 4], response_lengths=[4, 2, 6, 3], seed=0)


def make_engine(model_dir, layout="packed", optimizer=None, gradient_checkpointing=False, device="cpu"):
    from drivetrain_engine_megatron import MegatronEngine, MegatronEngineConfig

    engine = MegatronEngine(
        model_config=ModelConfig(
            path=str(model_dir),
            use_remove_padding=layout == "packed",
            gradient_checkpointing=gradient_checkpointing,
        ),
        engine_config=MegatronEngineConfig(micro_batch=MicroBatchConfig(micro_batch_size=3), device=device),
        optimizer_config=optimizer,
    )
    engine.initialize()
    return engine


def log_probs(engine, batch):
    with engine.eval_mode():
        return engine.infer_batch(batch).outputs["log_probs"]


def test_live_routes_replayed_change_no_log_prob(model_dir, batch):
    reference = load_reference_model(model_dir)
    routes = []
    for sequence in batch["input_ids"].unbind():
        record = plain_hf_top_k(reference, sequence).to(torch.int16)
        record[-1] = NOT_RECORDED  # never read by a rollout: routed live
        routes.append(record)
    for layout in ("packed", "padded"):
        engine = make_engine(model_dir, layout)
        live = log_probs(engine, batch).values()
        replayed = log_probs(engine, with_routes(batch, routes)).values()
        assert torch.equal(replayed, live)  # bit for bit


def test_other_routes_give_a_plain_hf_forward_forced_to_them(model_dir, batch):
    reference = load_reference_model(model_dir)
    sequences = batch["input_ids"].unbind()
    routes = [formula_routes(len(s), LAYERS, EXPERTS, TOP_K) for s in sequences]
    changed = sum(
        int(
            (plain_hf_top_k(reference, s)[:-1].sort(-1).values != r[:-1].long().sort(-1).values).any(-1).sum()
        )
        for s, r in zip(sequences, routes, strict=True)
    )
    assert changed > 20, "the formula's routes are mostly the live ones; the test would prove little"
    expected = [forced_log_probs(reference, s, r) for s, r in zip(sequences, routes, strict=True)]
    for layout in ("packed", "padded"):
        engine = make_engine(model_dir, layout)
        replayed = log_probs(engine, with_routes(batch, routes)).unbind()
        live = log_probs(engine, batch).unbind()
        gaps = [float((got[1:] - want).abs().max()) for got, want in zip(replayed, expected, strict=True)]
        assert max(gaps) < 1e-5, (layout, gaps)
        # The engine without the record routes live: far from the forced forward (the check can fail).
        live_gap = max(float((got[1:] - want).abs().max()) for got, want in zip(live, expected, strict=True))
        assert live_gap > 1e-3, layout


@requires_cuda  # megatron's layer recomputation saves CUDA RNG states: GPU lane only
def test_layer_recomputation_replays_the_micro_batchs_own_routes(model_dir, batch):
    """megatron recomputes each layer in backward under ``model.gradient_checkpointing``: with replay the
    recomputed routing is the record's, so two steps over two micro-batches give the steps without
    recomputation (whose replay agrees with the FSDP engine's, ``tests/test_moe_across_backends.py``)."""
    routed = with_routes(
        batch, [formula_routes(len(s), LAYERS, EXPERTS, TOP_K) for s in batch["input_ids"].unbind()]
    )

    def history(batch, gradient_checkpointing=False):
        engine = make_engine(
            model_dir, optimizer=OPTIMIZER, gradient_checkpointing=gradient_checkpointing, device="cuda"
        )
        return train_history(engine, [batch] * 2, token_mean_nll)

    replayed = history(routed)
    assert history(routed, gradient_checkpointing=True) == pytest.approx(replayed, rel=1e-6)
    assert history(batch) != pytest.approx(replayed, rel=1e-4), (
        "replay changed nothing; the test proves nothing"
    )


def test_what_cannot_be_replayed_is_refused_naming_the_option(model_dir, tmp_path):
    from drivetrain_engine_megatron.replay import MegatronRouterReplay

    batch = random_batch(vocab_size=100, prompt_lengths=[3], response_lengths=[2], seed=1)
    engine = make_engine(model_dir)
    other_model = [torch.zeros(5, 3, TOP_K, dtype=torch.int16)]
    with pytest.raises(
        BatchError, match=r"records 3 layers x top-2 per token, but the model routes 2 layers"
    ):
        log_probs(engine, with_routes(batch, other_model))
    routes = [formula_routes(5, LAYERS, EXPERTS, TOP_K)]
    trip = RoundTrip(
        loss_fn=None,
        options=ForwardOptions(),
        context=LossContext(global_token_count=0, global_sequence_count=1),
        gradient_divisor=1,
        keep_outputs=True,
    )
    micro_batch = MicroBatch.build(
        with_routes(batch, routes), 0, device="cpu", layout="packed", round_trip=trip
    )
    sequence_parallel = MegatronRouterReplay(engine._model.unwrapped, sequence_parallel=True)
    with pytest.raises(
        BatchError, match=r"engine.sequence_parallel=True is not supported .*router_replay=disabled"
    ):
        sequence_parallel.set(micro_batch)
    dense = make_engine(make_tiny_model_dir(tmp_path / "dense", arch="qwen2"))
    with pytest.raises(BatchError, match=r"no mixture-of-experts router .*rollout.router_replay=disabled"):
        log_probs(dense, with_routes(batch, routes))

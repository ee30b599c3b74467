"""The engine's AdamW and gradient clipping on local shards equal torch's AdamW and ``clip_grad_norm_`` run over
FSDP2's DTensors (what the engine ran before), bit for bit, on one rank and on two (plain and hybrid sharding)."""

from __future__ import annotations

import pytest
import torch
from drivetrain_engine_core.backend import ModelConfig, OptimizerConfig
from drivetrain_engine_core.job import MicroBatchConfig, shard_data
from drivetrain_engine_core.testing import make_tiny_model_dir, random_batch, run_distributed, token_mean_nll
from drivetrain_engine_core.testing.device import device_under_test
from drivetrain_engine_fsdp import engine as fsdp_engine
from drivetrain_engine_fsdp.config import FSDPEngineConfig
from drivetrain_engine_fsdp.optim import ShardLocalAdamW, trainable_parameters
from torch.distributed.tensor import DTensor

VOCAB = 100
STEPS = 3
# clip_grad 0.5 clips every step of the tiny model (its norms are above 1); weight decay exercises AdamW's own.
CLIPPED = OptimizerConfig(lr=1e-2, weight_decay=0.01, clip_grad=0.5)
UNCLIPPED = OptimizerConfig(lr=1e-2, weight_decay=0.01, clip_grad=None)


def torch_adamw(module, config):
    """torch's AdamW over the DTensor parameters (the engine's optimizer before it stepped on local shards)."""
    params = trainable_parameters(module)
    on_cuda = all(p.device.type == "cuda" for p in params)
    return torch.optim.AdamW(
        params,
        lr=config.lr,
        betas=config.betas,
        eps=config.eps,
        weight_decay=config.weight_decay,
        **({"fused": True} if on_cuda else {"foreach": True}),
    )


def torch_clip(module, max_norm):
    """torch's norm and clipping over the DTensor gradients, reduced by DTensor itself."""
    params = [p for p in trainable_parameters(module) if p.grad is not None]
    if max_norm is None:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    else:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return float((norm.full_tensor() if isinstance(norm, DTensor) else norm).item())


def train(model_dir, optimizer, *, reference, rank=0, world_size=1, **engine_options):
    """Grad norms, exported weights and AdamW moments after ``STEPS`` steps, with the engine's optimizer or torch's."""
    with pytest.MonkeyPatch.context() as patch:
        if reference:
            patch.setattr(fsdp_engine, "build_optimizer", torch_adamw)
            patch.setattr(fsdp_engine, "clip_grad_norm", torch_clip)
        engine = fsdp_engine.FSDPEngine(
            model_config=ModelConfig(path=str(model_dir)),
            engine_config=FSDPEngineConfig(
                device=device_under_test(), micro_batch=MicroBatchConfig(micro_batch_size=2), **engine_options
            ),
            optimizer_config=optimizer,
        )
        engine.initialize()
        assert isinstance(engine.optimizer, ShardLocalAdamW) != reference
        norms = []
        for seed in range(STEPS):
            batch = random_batch(
                vocab_size=VOCAB, prompt_lengths=[3, 5, 2, 4], response_lengths=[4, 2, 6, 3], seed=seed
            )
            with engine.train_mode():
                norms.append(engine.train_batch(shard_data(batch, rank, world_size), token_mean_nll).metrics)
    moments = [
        {name: value.full_tensor().cpu() for name, value in state.items() if isinstance(value, DTensor)}
        for state in engine.optimizer.state.values()
    ]
    return {
        "grad_norms": [m["grad_norm"] for m in norms],
        "weights": {name: tensor.cpu() for name, tensor in engine.export_weights()},
        "moments": moments,
        "steps": [float(state["step"]) for state in engine.optimizer.state.values()],
    }


def assert_identical(ours, theirs):
    assert ours["grad_norms"] == theirs["grad_norms"]
    assert ours["steps"] == theirs["steps"] == [float(STEPS)] * len(ours["steps"])
    assert ours["weights"].keys() == theirs["weights"].keys()
    for name, tensor in ours["weights"].items():
        assert torch.equal(tensor, theirs["weights"][name]), name
    assert len(ours["moments"]) == len(theirs["moments"])
    for mine, torchs in zip(ours["moments"], theirs["moments"], strict=True):
        assert mine.keys() == torchs.keys() == {"exp_avg", "exp_avg_sq"}
        assert all(torch.equal(mine[k], torchs[k]) for k in mine)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("optim") / "qwen2", arch="qwen2")


@pytest.mark.parametrize(
    ("optimizer", "options"),
    [
        (CLIPPED, {}),
        # The moments are parked in host buffers and re-wrapped between the steps.
        (UNCLIPPED, {"param_offload": True, "optimizer_offload": True}),
    ],
    ids=["clipped", "unclipped_offload"],
)
def test_local_shard_steps_equal_torch_over_dtensors_on_one_rank(model_dir, optimizer, options):
    ours = train(model_dir, optimizer, reference=False, **options)
    theirs = train(model_dir, optimizer, reference=True, **options)
    if optimizer.clip_grad is not None:
        assert min(ours["grad_norms"]) > optimizer.clip_grad  # the clip applied at every step
    assert_identical(ours, theirs)


def two_rank_worker(rank, world_size, model_dir):
    return {
        layout: (
            train(model_dir, CLIPPED, reference=False, rank=rank, world_size=world_size, **options),
            train(model_dir, CLIPPED, reference=True, rank=rank, world_size=world_size, **options),
        )
        for layout, options in {"dp2": {}, "hybrid": {"fsdp_size": 1}}.items()
    }


@pytest.mark.slow
def test_local_shard_steps_equal_torch_over_dtensors_on_two_ranks(model_dir):
    for result in run_distributed(two_rank_worker, str(model_dir), world_size=2, timeout_s=300):
        for ours, theirs in result.values():
            assert_identical(ours, theirs)

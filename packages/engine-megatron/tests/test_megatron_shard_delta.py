"""Delta streams of MegatronEngine decided from each rank's local shards (2 gloo ranks, fp32, TP2 and PP2).

One launch per layout: a full fine-tuning step with every decoder layer but the first frozen (embedding, head
and norms too), handed off as a delta on the untrained version; then the whole model trained one more step and
handed off as a delta on that. The parent computes from the exported tensors which changed and asserts the
sender gathered and sent exactly those bytes, and that each delta applied to its base is ``export_weights()``
bit for bit. Under PP2 the trained layer lives on the first stage only: the last stage's weights are never
broadcast.
"""

from __future__ import annotations

import pytest
import torch
from drivetrain_engine_core.backend import ModelConfig, OptimizerConfig
from drivetrain_engine_core.job import MicroBatchConfig
from drivetrain_engine_core.testing import make_tiny_model_dir, random_batch, run_distributed, token_mean_nll

pytestmark = pytest.mark.slow

# NOTE: no weight decay: megatron's optimizer holds the frozen parameters too (frozen after it was built) and
# steps them with zero gradients, which moves them by weight decay alone; without it they keep their bytes.
OPTIMIZER = OptimizerConfig(lr=1e-2, clip_grad=1.0, weight_decay=0.0)
LAYOUTS = {"tp2": {"tensor_model_parallel_size": 2}, "pp2": {"pipeline_model_parallel_size": 2}}
# The first of the tiny model's two decoder layers: under PP2 the first stage's output must need a gradient, or
# its backward has nothing to run (the embedding is frozen).
TRAINED_LAYER = 0
HAND_OFF_BOUND = 4096


def _engine(path: str, layout: dict):
    from drivetrain_engine_megatron import MegatronEngine, MegatronEngineConfig

    engine = MegatronEngine(
        model_config=ModelConfig(path=path),
        engine_config=MegatronEngineConfig(micro_batch=MicroBatchConfig(micro_batch_size=2), **layout),
        optimizer_config=OPTIMIZER,
    )
    engine.initialize()
    return engine


def _freeze_all_but(engine, layer_index: int) -> None:
    for chunk in engine._model.unwrapped:
        chunk.requires_grad_(False)
        for layer in chunk.decoder.layers:
            layer.requires_grad_(layer.layer_number - 1 == layer_index)


def _received(buckets) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for bucket in buckets for name, tensor in bucket.tensors()}


def _step_and_delta(engine, batch, version: int) -> dict:
    """Train one step, then hand version ``version`` off as a delta on ``version - 1``: what was sent and what
    the sender gathered and sent (bytes), and ``export_weights()`` after the step."""
    with engine.train_mode():
        engine.train_batch(batch, token_mean_nll)
    delta = list(
        engine.weight_buckets(version=version, base_version=version - 1, bucket_bytes=HAND_OFF_BOUND)
    )
    cost = engine.sent_weights.last
    return {
        "received": _received(delta),
        "sent": [name for bucket in delta for name in bucket.names],
        "gathered_bytes": cost.gathered,
        "sent_bytes": cost.sent,
        "exported": {name: tensor.clone() for name, tensor in engine.export_weights()},
    }


def _worker(rank: int, world_size: int, path: str, layout: dict) -> dict:
    del rank, world_size  # TP2 and PP2: both ranks see the whole batch
    batches = [
        random_batch(vocab_size=100, prompt_lengths=[3, 5, 2, 4], response_lengths=[5, 2, 6, 3], seed=s)
        for s in range(2)
    ]
    engine = _engine(path, layout)
    base = _received(engine.weight_buckets(version=0, bucket_bytes=HAND_OFF_BOUND))
    _freeze_all_but(engine, TRAINED_LAYER)
    frozen = _step_and_delta(engine, batches[0], version=1)
    for chunk in engine._model.unwrapped:
        chunk.requires_grad_(True)
    full = _step_and_delta(engine, batches[1], version=2)
    return {"base": base, "frozen": frozen, "full": full}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(make_tiny_model_dir(tmp_path_factory.mktemp("qwen2") / "model", arch="qwen2"))


def _nbytes(tensors) -> int:
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors)


def _assert_delta_gathers_only_changed(delta: dict, base: dict[str, torch.Tensor]) -> list[str]:
    """The delta on ``base`` applied to it is the export bit for bit, and it gathered and sent exactly the bytes
    of the tensors whose bytes changed (computed here); returns their names."""
    exported = delta["exported"]
    changed = [name for name, tensor in exported.items() if not torch.equal(tensor, base[name])]
    applied = {**base, **delta["received"]}
    assert list(applied) == list(exported)
    assert all(torch.equal(applied[name], tensor) for name, tensor in exported.items())
    assert delta["sent"] == changed
    changed_bytes = _nbytes(exported[name] for name in changed)
    assert (delta["gathered_bytes"], delta["sent_bytes"]) == (changed_bytes, changed_bytes)
    return changed


@pytest.mark.parametrize("layout_name", sorted(LAYOUTS))
def test_megatron_deltas_gather_only_the_changed_tensors(model_dir, layout_name):
    results = run_distributed(_worker, model_dir, LAYOUTS[layout_name], world_size=2, timeout_s=300)
    for result in results:
        base, frozen, full = result["base"], result["frozen"], result["full"]
        changed = _assert_delta_gathers_only_changed(frozen, base)
        assert changed == [name for name in base if name.startswith(f"model.layers.{TRAINED_LAYER}.")]
        assert _nbytes(frozen["exported"][name] for name in changed) < _nbytes(base.values()) / 2
        # The whole model trained: every tensor changed, so the delta gathers and sends all of it.
        assert _assert_delta_gathers_only_changed(full, frozen["exported"]) == list(base)

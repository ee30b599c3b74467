"""Delta streams of MegatronEngine decided from each rank's local shards (2 gloo ranks, fp32, TP2, PP2 and EP2).

One launch per layout: a full fine-tuning step with every decoder layer but the first frozen (embedding, head
and norms too), handed off as a delta on the untrained version; then the whole model trained one more step and
handed off as a delta on that. The parent computes from the exported tensors which changed and asserts the
sender gathered and sent exactly those bytes, and that each delta applied to its base is ``export_weights()``
bit for bit. Under PP2 the trained layer lives on the first stage only: the last stage's weights are never
broadcast. Under EP2 (the tiny Qwen3-MoE, two of its four experts per rank) the first version changes one expert
per rank instead, each in its own layer and at another local index (global experts 0 and 3, perturbed in place):
a group is one local expert index over both expert ranks, so each changed expert's peer on the other rank
(experts 2 and 1) is gathered too, and only the changed experts are sent.
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
LAYOUTS = {
    "tp2": ("qwen2", {"tensor_model_parallel_size": 2}),
    "pp2": ("qwen2", {"pipeline_model_parallel_size": 2}),
    "ep2": ("qwen3_moe", {"expert_model_parallel_size": 2}),
}
# The first of the tiny model's two decoder layers: under PP2 the first stage's output must need a gradient, or
# its backward has nothing to run (the embedding is frozen).
TRAINED_LAYER = 0
CHANGED_EXPERTS = ((0, 0), (1, 1))
"""Under EP2, the ``(layer, local expert)`` each rank changes: rank 0 layer 0's expert 0, rank 1 layer 1's expert
3 (its second; two experts per rank)."""
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


def _perturb_chosen_experts(engine, rank: int) -> None:
    """Add 0.01 to this rank's expert of :data:`CHANGED_EXPERTS` (megatron's sequential expert MLP: one module per
    local expert). NOTE: not trained frozen elsewhere: a rank whose layer has no trainable expert runs no
    backward through that layer's token exchange, which the other rank waits in (the step hangs)."""
    layer_index, local = CHANGED_EXPERTS[rank]
    with torch.no_grad():
        for chunk in engine._model.unwrapped:
            for layer in chunk.decoder.layers:
                if layer.layer_number - 1 == layer_index:
                    for parameter in layer.mlp.experts.local_experts[local].parameters():
                        parameter.add_(0.01)


def _train(engine, batch) -> None:
    with engine.train_mode():
        engine.train_batch(batch, token_mean_nll)


def _received(buckets) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for bucket in buckets for name, tensor in bucket.tensors()}


def _delta(engine, version: int) -> dict:
    """Hand version ``version`` off as a delta on ``version - 1``: what was sent and what the sender gathered and
    sent (bytes), and ``export_weights()``."""
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
    del world_size  # both ranks see the whole batch
    batches = [
        random_batch(vocab_size=100, prompt_lengths=[3, 5, 2, 4], response_lengths=[5, 2, 6, 3], seed=s)
        for s in range(2)
    ]
    engine = _engine(path, layout)
    base = _received(engine.weight_buckets(version=0, bucket_bytes=HAND_OFF_BOUND))
    if "expert_model_parallel_size" in layout:
        _perturb_chosen_experts(engine, rank)
    else:
        _freeze_all_but(engine, TRAINED_LAYER)
        _train(engine, batches[0])
    frozen = _delta(engine, version=1)
    for chunk in engine._model.unwrapped:
        chunk.requires_grad_(True)
    _train(engine, batches[1])
    full = _delta(engine, version=2)
    return {"base": base, "frozen": frozen, "full": full}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("models")
    return {arch: str(make_tiny_model_dir(root / arch, arch=arch)) for arch in ("qwen2", "qwen3_moe")}


def _nbytes(tensors) -> int:
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors)


def _assert_delta_gathers_only_changed(
    delta: dict, base: dict[str, torch.Tensor], peers: tuple[str, ...] = ()
) -> list[str]:
    """The delta on ``base`` applied to it is the export bit for bit, and it sent exactly the bytes of the tensors
    whose bytes changed (computed here) and gathered those and the unchanged ``peers`` (name prefixes) that share
    their groups; returns the changed names."""
    exported = delta["exported"]
    changed = [name for name, tensor in exported.items() if not torch.equal(tensor, base[name])]
    applied = {**base, **delta["received"]}
    assert list(applied) == list(exported)
    assert all(torch.equal(applied[name], tensor) for name, tensor in exported.items())
    assert delta["sent"] == changed
    changed_bytes = _nbytes(exported[name] for name in changed)
    peer_bytes = _nbytes(tensor for name, tensor in exported.items() if name.startswith(peers))
    assert (delta["gathered_bytes"], delta["sent_bytes"]) == (changed_bytes + peer_bytes, changed_bytes)
    return changed


def _expert(layer: int, expert: int) -> str:
    return f"model.layers.{layer}.mlp.experts.{expert}."


def _trained_and_peers(layout_name: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The name prefixes of what the first version changes and of the unchanged tensors its delta gathers with them:
    under EP2 each trained expert's peer, the other expert rank's expert of the same local index."""
    if layout_name != "ep2":
        return (f"model.layers.{TRAINED_LAYER}.",), ()
    per_rank = 2
    trained = tuple(
        _expert(layer, rank * per_rank + local) for rank, (layer, local) in enumerate(CHANGED_EXPERTS)
    )
    peers = tuple(
        _expert(layer, (1 - rank) * per_rank + local) for rank, (layer, local) in enumerate(CHANGED_EXPERTS)
    )
    return trained, peers


@pytest.mark.parametrize("layout_name", sorted(LAYOUTS))
def test_megatron_deltas_gather_only_the_changed_tensors(model_dirs, layout_name):
    arch, layout = LAYOUTS[layout_name]
    results = run_distributed(_worker, model_dirs[arch], layout, world_size=2, timeout_s=300)
    trained, peers = _trained_and_peers(layout_name)
    for result in results:
        base, frozen, full = result["base"], result["frozen"], result["full"]
        changed = _assert_delta_gathers_only_changed(frozen, base, peers)
        assert changed == [name for name in base if name.startswith(trained)]
        assert _nbytes(frozen["exported"][name] for name in changed) < _nbytes(base.values()) / 2
        # The whole model trained: every tensor changed, so the delta gathers and sends all of it.
        assert _assert_delta_gathers_only_changed(full, frozen["exported"]) == list(base)

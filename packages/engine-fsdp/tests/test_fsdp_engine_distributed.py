"""Two-rank FSDP engine (gloo) against a plain single-process Hugging Face reference.

One launch runs every scenario (plain data parallel, dynamic micro-batches, hybrid sharding, Ulysses, LoRA,
offload, uneven shares with filler passes, checkpoint save, weight hand-off in buckets, deltas of frozen layers)
and returns numbers; the parent computes the references and asserts, and resumes the 2-rank checkpoint on 1 rank.
"""

from __future__ import annotations

import pytest
import torch
from drivetrain_engine_core._data.rows import select_rows
from drivetrain_engine_core._handoff import ExportBytes
from drivetrain_engine_core.backend import ForwardOptions, LoraConfig, ModelConfig, OptimizerConfig
from drivetrain_engine_core.job import LossContext, MicroBatchConfig, shard_data, shard_indices
from drivetrain_engine_core.testing import (
    load_reference_model,
    make_tiny_model_dir,
    random_batch,
    reference_log_probs,
    reference_loss_and_grad_norm,
    reference_outputs,
    run_distributed,
    token_mean_nll,
)
from drivetrain_engine_core.testing.reference import grad_norm
from drivetrain_engine_fsdp.config import FSDPEngineConfig
from drivetrain_engine_fsdp.engine import FSDPEngine

VOCAB = 100
OPTIMIZER = OptimizerConfig(lr=1e-2, clip_grad=1.0)
LORA = LoraConfig(rank=4, alpha=8.0, target_modules=("q_proj", "k_proj", "v_proj", "o_proj"))
SCENARIOS = {
    "dp2": {},
    "dp2_dynamic": {"micro_batch": MicroBatchConfig(micro_batch_size=None, max_tokens=14)},
    "hybrid": {"fsdp_size": 1},
    # Odd micro-batch token counts (15, ...) exercise the row padding; checkpointing re-runs the all-to-alls.
    "ulysses2": {"ulysses_sequence_parallel_size": 2, "gradient_checkpointing": True},
    "lora_dp2": {},
    # Parameters parked in host buffers between the modes (each mode block loads and offloads again).
    "dp2_offload": {"param_offload": True, "optimizer_offload": True},
    # Rank 1 holds one sequence for the group's 5 micro-batches: it runs 4 filler passes (their forwards and
    # backwards pair FSDP's all-gathers and reduce-scatters with rank 0's); it used to be a BatchError.
    "dp2_uneven": {"micro_batch": MicroBatchConfig(micro_batch_size=1)},
}
UNEVEN_SHARES = ([0, 1, 2, 3, 4], [5])
TRAINED_LAYER = "model.layers.1."


def global_batch(seed=0):
    return random_batch(
        vocab_size=VOCAB, prompt_lengths=[3, 5, 2, 4, 6, 1], response_lengths=[5, 2, 7, 3, 5, 6], seed=seed
    )


def build_engine(model_dir, *, lora=None, gradient_checkpointing=False, **engine):
    engine.setdefault("micro_batch", MicroBatchConfig(micro_batch_size=2))
    instance = FSDPEngine(
        model_config=ModelConfig(
            path=str(model_dir), lora=lora, gradient_checkpointing=gradient_checkpointing
        ),
        engine_config=FSDPEngineConfig(**engine),
        optimizer_config=OPTIMIZER,
    )
    instance.initialize()
    return instance


def run_scenario(engine, batch, shares=None):
    """Log-probs before training, then one train step: the numbers the parent checks."""
    rank = engine.data_parallel_rank
    if shares is None:
        local = shard_data(batch, rank, engine.data_parallel_size, balance=True)
    else:
        local = select_rows(batch, torch.tensor(shares[rank]))
    with engine.eval_mode():
        outputs = engine.infer_batch(local, options=ForwardOptions(temperature=0.9)).outputs
    bases = {mode: received(engine.weight_buckets(version=0, lora=mode)) for mode in lora_modes(engine)}
    with engine.train_mode():
        step = engine.train_batch(local, token_mean_nll)
    log_probs = None if outputs is None else [t.clone() for t in outputs["log_probs"].unbind()]
    return {
        "log_probs": log_probs,
        "loss": step.loss,
        "grad_norm": step.metrics["grad_norm"],
        "hand_off": hand_off(engine),
        "delta": {mode: delta_hand_off(engine, base, mode) for mode, base in bases.items()},
    }


HAND_OFF_BOUND = 2048


def hand_off(engine):
    """The trained weights as ``export_weights`` yields them and as a bucket receiver gets them."""
    buckets = [
        (b.nbytes, len(b.specs), b.last)
        for b in engine.weight_buckets(version=1, bucket_bytes=HAND_OFF_BOUND)
    ]
    result = {
        "exported": {name: tensor.clone() for name, tensor in engine.export_weights()},
        "received": received(engine.weight_buckets(version=1, bucket_bytes=HAND_OFF_BOUND)),
        "buckets": buckets,
    }
    if engine.model_config.lora is not None:
        result["adapters"] = received(
            engine.weight_buckets(version=1, bucket_bytes=HAND_OFF_BOUND, lora="adapter")
        )
    return result


def received(buckets):
    return {name: tensor.clone() for bucket in buckets for name, tensor in bucket.tensors()}


def lora_modes(engine):
    return ("merged", "adapter") if engine.model_config.lora is not None else ("merged",)


def delta_hand_off(engine, base, lora):
    """Version 1 as a delta on version 0 (streamed before the step), applied to what version 0 delivered, and
    (merged) the bytes the sender gathered and sent, deciding from each rank's local shards what changed."""
    buckets = list(engine.weight_buckets(version=1, base_version=0, bucket_bytes=HAND_OFF_BOUND, lora=lora))
    return {
        "base": base,
        "applied": {**base, **received(buckets)},
        "sent": [name for bucket in buckets for name in bucket.names],
        "bases": {bucket.base_version for bucket in buckets},
        "export_bytes": engine.sent_weights.last if lora == "merged" else None,
    }


def frozen_hand_off(model_dir, batch, rank, world_size):
    """A full fine-tuning step with every layer but :data:`TRAINED_LAYER` frozen, handed off as a delta."""
    engine = build_engine(model_dir)
    for name, parameter in engine.module.named_parameters():
        parameter.requires_grad_(name.startswith(TRAINED_LAYER))
    base = received(engine.weight_buckets(version=0, bucket_bytes=HAND_OFF_BOUND))
    with engine.train_mode():
        engine.train_batch(shard_data(batch, rank, world_size), token_mean_nll)
    exported = {name: tensor.clone() for name, tensor in engine.export_weights()}
    return {**delta_hand_off(engine, base, "merged"), "exported": exported}


def two_rank_worker(rank, world_size, model_dir, checkpoint_root):
    results = {}
    batch = global_batch()
    for name, engine_kwargs in SCENARIOS.items():
        lora = LORA if name.startswith("lora") else None
        shares = UNEVEN_SHARES if name == "dp2_uneven" else None
        results[name] = run_scenario(build_engine(model_dir, lora=lora, **engine_kwargs), batch, shares)
    results["frozen"] = frozen_hand_off(model_dir, batch, rank, world_size)
    engine = build_engine(model_dir)
    with engine.train_mode():
        engine.train_batch(shard_data(batch, rank, world_size), token_mean_nll)
    engine.save_checkpoint(checkpoint_root, global_step=1)
    second = global_batch(seed=1)
    with engine.train_mode():
        results["after_resume"] = engine.train_batch(
            shard_data(second, rank, world_size), token_mean_nll
        ).loss
    return results


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    model_dir = make_tiny_model_dir(root / "qwen2", arch="qwen2")
    results = run_distributed(
        two_rank_worker, str(model_dir), str(root / "ckpt"), world_size=2, timeout_s=600
    )
    return model_dir, root / "ckpt", results


def restore_order(batch, per_rank_log_probs, shares=None):
    """Global-order log-probs from each data-parallel rank's shard outputs."""
    if shares is None:
        indices = shard_indices(batch, len(per_rank_log_probs), balance=True)
    else:
        indices = [torch.tensor(share) for share in shares]
    restored = [None] * len(batch)
    for rank_indices, rank_values in zip(indices, per_rank_log_probs, strict=True):
        for index, values in zip(rank_indices.tolist(), rank_values, strict=True):
            restored[index] = values
    return torch.cat(restored)


def lora_reference(model_dir, batch):
    """Loss and grad norm of the same seeded PEFT model, run plainly on one process."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    torch.manual_seed(0)  # the engine's default seed, so the adapters start from the same values
    model = load_reference_model(model_dir)
    peft_config = PeftLoraConfig(r=LORA.rank, lora_alpha=LORA.alpha, target_modules=list(LORA.target_modules))
    model = get_peft_model(model, peft_config)
    outputs = reference_outputs(model, batch, "language_model")
    context = LossContext(
        global_token_count=int(batch["loss_mask"].values().sum()),
        global_sequence_count=len(batch),
    )
    loss, _ = token_mean_nll(outputs, batch, context)
    loss.backward()
    return float(loss.detach()), grad_norm([p for p in model.parameters() if p.requires_grad])


@pytest.mark.slow
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_two_rank_scenario_matches_reference(launched, scenario):
    model_dir, _, results = launched
    batch = global_batch()
    if scenario.startswith("lora"):
        loss, norm = lora_reference(model_dir, batch)
    else:
        loss, norm = reference_loss_and_grad_norm(model_dir, batch, token_mean_nll)
    for rank_result in results:
        assert rank_result[scenario]["loss"] == pytest.approx(loss, rel=1e-5)
        assert rank_result[scenario]["grad_norm"] == pytest.approx(norm, rel=1e-5)
    reference = reference_log_probs(model_dir, batch, temperature=0.9).values()
    if scenario == "ulysses2":  # one data-parallel rank; its first SP rank holds the outputs
        assert results[1][scenario]["log_probs"] is None
        produced = torch.cat(results[0][scenario]["log_probs"])
    else:
        shares = UNEVEN_SHARES if scenario == "dp2_uneven" else None
        produced = restore_order(batch, [r[scenario]["log_probs"] for r in results], shares)
    assert float((produced - reference).abs().max()) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_two_rank_weight_buckets_equal_export_weights(launched, scenario):
    """Every rank receives ``export_weights()`` bit for bit in bounded buckets (sharded params gathered one at
    a time); with LoRA the adapter stream folds into the merged weights exactly."""
    model_dir, _, results = launched
    first = results[0][scenario]["hand_off"]
    for rank_result in results:
        result = rank_result[scenario]["hand_off"]
        assert list(result["received"]) == list(result["exported"])
        for name, tensor in result["exported"].items():
            assert torch.equal(result["received"][name], tensor), name
            assert torch.equal(first["received"][name], tensor), f"ranks received different {name}"
        assert all(nbytes <= HAND_OFF_BOUND or count == 1 for nbytes, count, _ in result["buckets"])
        assert [last for *_, last in result["buckets"]] == [False] * (len(result["buckets"]) - 1) + [True]
    if "adapters" in first:
        base = load_reference_model(model_dir).state_dict()
        scale = LORA.alpha / LORA.rank
        adapters = first["adapters"]
        assert len(adapters) == 2 * 2 * len(LORA.target_modules)  # A and B, 2 layers, each target module
        for name in (n for n in adapters if n.endswith("lora_A.weight")):
            module = name.removesuffix(".lora_A.weight")
            hf_name = module.removeprefix("base_model.model.") + ".weight"
            delta = (adapters[f"{module}.lora_B.weight"].float() @ adapters[name].float()) * scale
            assert torch.equal(first["received"][hf_name], base[hf_name] + delta), hf_name


@pytest.mark.slow
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_two_rank_delta_streams_equal_full_streams(launched, scenario):
    """Version 1 as a delta on version 0, applied to version 0, equals the full version 1 bit for bit on every
    rank, and sends exactly the tensors that differ between the two. A full fine-tuning step with Adam moves
    every tensor, so the delta sends all of them; a LoRA step moves only the adapted weights (merged)."""
    _, _, results = launched
    for rank_result in results:
        full, deltas = rank_result[scenario]["hand_off"], rank_result[scenario]["delta"]
        expected = {"merged": full["received"], "adapter": full.get("adapters")}
        for mode, delta in deltas.items():
            assert delta["bases"] == {0}, mode
            assert list(delta["applied"]) == list(expected[mode]), mode
            for name, tensor in expected[mode].items():
                assert torch.equal(delta["applied"][name], tensor), (mode, name)
        adapted = [
            n for n in full["received"] if n.endswith(".weight") and n.split(".")[-2] in LORA.target_modules
        ]
        changed = adapted if scenario.startswith("lora") else list(full["received"])
        assert deltas["merged"]["sent"] == changed
        # Decided from each rank's local shards: only the changed tensors were gathered.
        changed_bytes = nbytes(full["received"][name] for name in changed)
        assert deltas["merged"]["export_bytes"] == ExportBytes(gathered=changed_bytes, sent=changed_bytes)
        if "adapter" in deltas:
            assert deltas["adapter"]["sent"] == list(full["adapters"])


@pytest.mark.slow
def test_two_rank_deltas_of_frozen_layers_gather_only_the_trained_layer(launched):
    """Every layer but the last frozen: the delta gathers and sends exactly the tensors whose bytes changed (the
    trained layer's, computed here from version 0 and the engine's state), and applied to version 0 it is the
    engine's full state bit for bit."""
    for rank_result in launched[2]:
        result = rank_result["frozen"]
        exported, base = result["exported"], result["base"]
        changed = [name for name in exported if not torch.equal(exported[name], base[name])]
        assert changed == [name for name in exported if name.startswith(TRAINED_LAYER)]
        assert result["sent"] == changed
        assert list(result["applied"]) == list(exported)
        assert all(torch.equal(result["applied"][name], tensor) for name, tensor in exported.items())
        changed_bytes = nbytes(exported[name] for name in changed)
        assert changed_bytes < nbytes(exported.values()) / 2
        assert result["export_bytes"] == ExportBytes(gathered=changed_bytes, sent=changed_bytes)


def nbytes(tensors):
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors)


@pytest.mark.slow
def test_two_rank_checkpoint_resumes_on_one_rank(launched):
    model_dir, checkpoint_root, results = launched
    engine = build_engine(model_dir)
    assert engine.load_checkpoint(checkpoint_root)["global_step"] == 1
    with engine.train_mode():
        loss = engine.train_batch(global_batch(seed=1), token_mean_nll).loss
    assert loss == pytest.approx(results[0]["after_resume"], rel=1e-6)

"""MegatronEngine at TP2, PP2 and DP2 (2 gloo ranks, fp32) against a plain single-process Hugging Face model.

One launch per layout (TP2, PP2, PP2 x VPP2, DP2, and a tied output layer at TP2 with a padded vocabulary and
at PP2) runs every check and returns numbers; the parent computes the references and asserts:
log-probs/entropy (packed and padded), first-step loss and grad norm, a 5-step loss curve, a bit-exact
checkpoint resume, weights exported equal to the Hugging Face state dict, the weight hand-off in bounded buckets
equal to the export bit for bit on every rank, and (TP2) the value model. The TP2+SP and PP2 x VPP2 steps
(distributed optimizer) are also resumed on one rank in the test process: their moments move through the
layout record exactly.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from drivetrain_engine_core.backend import ModelConfig, OptimizerConfig
from drivetrain_engine_core.job import MicroBatchConfig
from drivetrain_engine_core.testing import (
    make_tiny_model_dir,
    random_batch,
    reference_entropy,
    reference_log_probs,
    reference_train_losses,
    reference_values,
    run_distributed,
    token_mean_nll,
    train_history,
    value_mse,
)
from safetensors.torch import load_file

pytestmark = pytest.mark.slow

TEMPERATURE = 0.7
STEPS, SAVE_AT = 5, 2
OPTIMIZER = OptimizerConfig(lr=1e-3, clip_grad=1.0, warmup_steps=2, weight_decay=0.01)
LAYOUTS = {
    # The vocabulary padded to a multiple of 8: the value model's one-row head must not be (mbridge padded and
    # trimmed every ``output_layer.weight``, so loading and exporting a value model failed).
    "tp2": ("qwen2", {"tensor_model_parallel_size": 2, "make_vocab_size_divisible_by": 4}, True),
    "pp2": ("llama", {"pipeline_model_parallel_size": 2}, False),
    "dp2": ("qwen2", {}, False),
    # Sequence parallelism: packed rows padded to a multiple of 2 (core's RowPadding), norms on token shards
    # whose weight gradients are summed over the TP ranks, heads that gather the tokens back.
    "tp2-sp": ("qwen2", {"tensor_model_parallel_size": 2, "sequence_parallel": True}, True),
    "pp2-vpp2": (
        "qwen2-4-layers",
        {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2},
        False,
    ),
    # Tied output layer: the embedding's rows on each TP rank, the vocabulary of 110 padded to 112 (rank 1's
    # last two rows are padding), and logits computed 3 positions at a time.
    "tp2-tied-padded": (
        "qwen2-tied",
        {
            "tensor_model_parallel_size": 2,
            "make_vocab_size_divisible_by": 4,
            "entropy_chunk_size": 3,
        },
        False,
    ),
    # Tied output layer on a last stage without the embedding: megatron's own copy of it; with the distributed
    # optimizer, whose bucket there ends inside alignment padding (dist_opt_padding.py).
    # A tied Llama-family model (SmolLM2): LLaMABridge read the last stage's output layer from lm_head.weight.
    "pp2-llama-tied": ("llama-tied", {"pipeline_model_parallel_size": 2}, False),
    "pp2-tied": (
        "qwen2-tied",
        {"pipeline_model_parallel_size": 2},
        # The value model of a tied model: its last stage's output layer is the value head, not the embedding
        # (tied, its gradient was all-reduced with the embedding's and it was checkpointed under its key).
        True,
    ),
}


ONE_SEQUENCE = MicroBatchConfig(micro_batch_size=1)


def _batches(vocab_size: int, with_returns: bool = False) -> list:
    """Batches of 4 sequences; seeds 2 and 3 contain the pad token (id 0), whose embedding row HF never trains."""
    return [
        random_batch(
            vocab_size=vocab_size,
            prompt_lengths=[3, 5, 2, 4],
            response_lengths=[4, 2, 6, 3],
            seed=seed,
            with_returns=with_returns,
        )
        for seed in range(STEPS)
    ]


def _engine(
    path: str,
    layout: dict,
    *,
    model_type: str = "language_model",
    use_remove_padding: bool = True,
    micro_batch: MicroBatchConfig = ONE_SEQUENCE,
):
    from drivetrain_engine_megatron.config import MegatronEngineConfig
    from drivetrain_engine_megatron.engine import MegatronEngine

    engine = MegatronEngine(
        model_config=ModelConfig(path=path, model_type=model_type, use_remove_padding=use_remove_padding),
        engine_config=MegatronEngineConfig(micro_batch=micro_batch, **layout),
        optimizer_config=OPTIMIZER,
    )
    engine.initialize()
    return engine


def _infer(engine, batch, keys: tuple[str, ...]) -> dict[str, torch.Tensor] | None:
    from drivetrain_engine_core.backend import ForwardOptions

    with engine.eval_mode():
        options = ForwardOptions(temperature=TEMPERATURE, compute_entropy=True) if "entropy" in keys else None
        output = engine.infer_batch(batch, options=options)
    if not engine.is_output_rank:
        return None
    return {key: output.outputs[key].values() for key in keys}


def _language_checks(path: str, layout: dict, vocab_size: int, checkpoint_root: str) -> dict:
    batches = _batches(vocab_size)
    engine = _engine(path, layout)
    result = {"exported": dict(engine.export_weights())}
    base = _received(engine.weight_buckets(version=0))  # the base of a delta stream after training
    result["packed"] = _infer(engine, batches[0], ("log_probs", "entropy"))
    # Sequence parallelism splits packed rows only (padded rows are refused).
    result["padded"] = (
        None
        if layout.get("sequence_parallel")
        else _infer(_engine(path, layout, use_remove_padding=False), batches[0], ("log_probs", "entropy"))
    )
    result["history"] = train_history(engine, batches[:SAVE_AT], token_mean_nll)
    engine.save_checkpoint(checkpoint_root, global_step=SAVE_AT, extra_state={"position": SAVE_AT})
    result["exported_at_save"] = dict(engine.export_weights())
    result["hand_off"] = _hand_off(engine)
    delta = list(engine.weight_buckets(version=SAVE_AT, base_version=0, bucket_bytes=HAND_OFF_BOUND))
    result["delta"] = {
        "base": base,
        "applied": {**base, **_received(delta)},
        "sent": [name for bucket in delta for name in bucket.names],
        "bytes": (engine.sent_weights.last.gathered, engine.sent_weights.last.sent),
    }
    continued = train_history(engine, batches[SAVE_AT:], token_mean_nll)
    result["history"] += continued
    resumed_engine = _engine(path, layout)
    result["extra"] = resumed_engine.load_checkpoint(checkpoint_root)
    result["continued"], result["resumed"] = (
        continued,
        train_history(resumed_engine, batches[SAVE_AT:], token_mean_nll),
    )
    return result


HAND_OFF_BOUND = 4096


def _received(buckets) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for bucket in buckets for name, tensor in bucket.tensors()}


def _hand_off(engine) -> dict:
    """What a bucket receiver gets of the trained weights (gathered over TP and PP one tensor at a time)."""
    received, buckets, names = {}, [], []
    for bucket in engine.weight_buckets(version=SAVE_AT, bucket_bytes=HAND_OFF_BOUND):
        buckets.append((bucket.nbytes, len(bucket.specs), bucket.index, bucket.last))
        names += [name for name, _ in bucket.tensors()]
        received.update((name, tensor.clone()) for name, tensor in bucket.tensors())
    return {"received": received, "buckets": buckets, "names": names}


def _assert_hand_off_equals_export(language: dict) -> None:
    received, exported = language["hand_off"]["received"], language["exported_at_save"]
    assert list(received) == list(exported)
    assert language["hand_off"]["names"] == list(received)  # each tensor sent once (tied PP sent one twice)
    for name, tensor in exported.items():
        assert torch.equal(received[name], tensor), name
    buckets = language["hand_off"]["buckets"]
    assert all(nbytes <= HAND_OFF_BOUND or count == 1 for nbytes, count, *_ in buckets)
    assert [(index, last) for *_, index, last in buckets] == [
        (i, i == len(buckets) - 1) for i in range(len(buckets))
    ]
    # The delta on the untrained version, applied to it, is the full stream bit for bit, and gathers and sends
    # exactly the tensors the steps changed (decided from each rank's local shards).
    delta = language["delta"]
    assert list(delta["applied"]) == list(received)
    assert all(torch.equal(delta["applied"][name], tensor) for name, tensor in received.items())
    changed = [n for n, t in received.items() if not torch.equal(t, delta["base"][n])]
    assert delta["sent"] == changed
    changed_bytes = sum(received[n].numel() * received[n].element_size() for n in changed)
    assert delta["bytes"] == (changed_bytes, changed_bytes)


def _value_checks(path: str, layout: dict, vocab_size: int, root: str) -> dict:
    batches = _batches(vocab_size, with_returns=True)[:2]
    engine = _engine(path, layout, model_type="value_model")
    result = {"exported": dict(engine.export_weights()), "values": _infer(engine, batches[0], ("values",))}
    result["history"] = train_history(engine, batches, value_mse)
    engine.save_checkpoint(root, global_step=len(batches))
    result["exported_at_save"] = dict(engine.export_weights())
    return result


# Sequence lengths 7, 7, 8, 7: one micro-batch of 4 sequences, or 3 under a 14-token budget. The interleaved
# schedule needs a multiple of the pipeline size, so the engine must run 2 and 4.
ODD_COUNT_MICRO_BATCHES = (
    MicroBatchConfig(micro_batch_size=4),
    MicroBatchConfig(micro_batch_size=None, max_tokens=14),
)


def _odd_count_checks(path: str, layout: dict, vocab_size: int) -> list[tuple[float, float]]:
    batch = _batches(vocab_size)[0]
    return [
        train_history(_engine(path, layout, micro_batch=mb), [batch], token_mean_nll)[0]
        for mb in ODD_COUNT_MICRO_BATCHES
    ]


def _worker(
    rank: int, world_size: int, paths: dict, layout: dict, vocab_size: int, root: str, with_value: bool
):
    del world_size
    result = {"language": _language_checks(paths["language_model"], layout, vocab_size, f"{root}/lm")}
    if layout.get("virtual_pipeline_model_parallel_size"):
        result["odd_counts"] = _odd_count_checks(paths["language_model"], layout, vocab_size)
    if with_value:
        result["value"] = _value_checks(paths["value_model"], layout, vocab_size, f"{root}/value")
    result["rank"] = rank
    return result


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, dict[str, str]]:
    dirs = {}
    for arch in ("qwen2", "llama"):
        root = tmp_path_factory.mktemp(arch)
        dirs[arch] = {
            model_type: str(make_tiny_model_dir(root / model_type, arch=arch, model_type=model_type))
            for model_type in ("language_model", "value_model")
        }
    # Virtual pipeline: 2 stages x 2 chunks needs 4 layers.
    deep = tmp_path_factory.mktemp("qwen2-4-layers") / "language_model"
    dirs["qwen2-4-layers"] = {
        "language_model": str(make_tiny_model_dir(deep, arch="qwen2", num_hidden_layers=4))
    }
    llama_tied = tmp_path_factory.mktemp("llama-tied") / "language_model"
    dirs["llama-tied"] = {
        "language_model": str(make_tiny_model_dir(llama_tied, arch="llama", tie_word_embeddings=True))
    }
    # With its pad token (seeds 2 and 3 hold it): the tied row trains through the pad token's logit only.
    tied = tmp_path_factory.mktemp("qwen2-tied") / "language_model"
    dirs["qwen2-tied"] = {
        model_type: str(
            make_tiny_model_dir(
                tied.parent / model_type, arch="qwen2", tie_word_embeddings=True, model_type=model_type
            )
        )
        for model_type in ("language_model", "value_model")
    }
    return dirs


def _hf_state(path: str) -> dict[str, torch.Tensor]:
    state = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        state.update(load_file(file))
    return state


def _assert_exported_equal(exported: dict[str, torch.Tensor], path: str) -> None:
    reference = _hf_state(path)
    assert sorted(exported) == sorted(reference)
    for name, tensor in reference.items():
        assert torch.equal(exported[name], tensor), name


def _assert_curve(history, reference, first_rtol: float = 1e-5, curve_atol: float = 1e-4) -> None:
    (loss, norm), (ref_loss, ref_norm) = history[0], reference[0]
    assert math.isclose(loss, ref_loss, rel_tol=first_rtol), (loss, ref_loss)
    assert math.isclose(norm, ref_norm, rel_tol=first_rtol), (norm, ref_norm)
    for (loss, _), (ref_loss, _) in zip(history, reference, strict=True):
        assert abs(loss - ref_loss) < curve_atol, (history, reference)


@pytest.mark.parametrize("layout_name", sorted(LAYOUTS))
def test_megatron_layout_matches_hugging_face(layout_name, model_dirs, tmp_path):
    from transformers import AutoConfig

    arch, layout, with_value = LAYOUTS[layout_name]
    paths = model_dirs[arch]
    lm_path = paths["language_model"]
    vocab_size = AutoConfig.from_pretrained(lm_path).vocab_size
    results = run_distributed(
        _worker, paths, layout, vocab_size, str(tmp_path), with_value, world_size=2, timeout_s=540
    )
    batches = _batches(vocab_size)
    expected_log_probs = reference_log_probs(lm_path, batches[0], temperature=TEMPERATURE).values()
    expected_entropy = reference_entropy(lm_path, batches[0], temperature=TEMPERATURE).values()
    reference = reference_train_losses(lm_path, batches, OPTIMIZER, token_mean_nll)
    outputs = [r["language"] for r in results if r["language"]["packed"] is not None]
    assert outputs, "no rank reported outputs"
    for language in (r["language"] for r in results):
        _assert_exported_equal(language["exported"], lm_path)
        _assert_curve(language["history"], reference)
        assert language["resumed"] == language["continued"]
        _assert_hand_off_equals_export(language)
        assert language["extra"] == {"global_step": SAVE_AT, "position": SAVE_AT}
    for result in results:
        for loss, norm in result.get("odd_counts", []):
            assert math.isclose(loss, reference[0][0], rel_tol=1e-5) and math.isclose(
                norm, reference[0][1], rel_tol=1e-5
            )
    for language in outputs:
        for layout_key in ("packed", "padded"):
            got = language[layout_key]
            if got is None:
                continue
            torch.testing.assert_close(got["log_probs"], expected_log_probs, atol=1e-5, rtol=0)
            torch.testing.assert_close(got["entropy"], expected_entropy, atol=1e-5, rtol=0)
    _assert_merged_equal_export(
        tmp_path / "lm" / f"global_step_{SAVE_AT}", results[0]["language"]["exported_at_save"]
    )
    if layout_name in RESUMED_ON_ONE_RANK:
        _assert_resumes_on_one_rank(lm_path, vocab_size, tmp_path / "lm", results[0]["language"]["continued"])
    if with_value:
        _check_value_model(results, paths["value_model"], vocab_size)
        _assert_merged_equal_export(
            tmp_path / "value" / "global_step_2", results[0]["value"]["exported_at_save"]
        )


RESUMED_ON_ONE_RANK = ("tp2-sp", "pp2-vpp2")
"""Layouts whose distributed-optimizer step (flat per-bucket moments, mapped through the layout record) also
continues on one rank, in this process: no launch of its own."""


def _assert_resumes_on_one_rank(path: str, vocab_size: int, root: Path, continued: list) -> None:
    """The layout's step resumed on one Megatron rank trains the remaining steps as the layout did uninterrupted
    (loss and grad norm within 1e-5 each step): weights, Adam moments and step all moved."""
    engine = _engine(path, {})
    assert engine.load_checkpoint(root) == {"global_step": SAVE_AT, "position": SAVE_AT}
    resumed = train_history(engine, _batches(vocab_size)[SAVE_AT:], token_mean_nll)
    for step, (got, want) in enumerate(zip(resumed, continued, strict=True), start=SAVE_AT + 1):
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6), (step, got, want)


def _assert_merged_equal_export(step_dir: Path, exported: dict[str, torch.Tensor]) -> None:
    """The checkpoint's model tensors, converted offline (no process group), equal the live export."""
    from drivetrain_engine_core.kit import read_manifest
    from drivetrain_engine_megatron.hf_names import checkpoint_tensors_to_hf
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers import AutoConfig

    info = read_manifest(step_dir).backend_info
    flat = step_dir.parent / "model.pt"
    dcp_to_torch_save(step_dir / info["model_dir"], flat)
    tensors = torch.load(flat, weights_only=False)
    merged = dict(
        checkpoint_tensors_to_hf(
            AutoConfig.from_pretrained(read_manifest(step_dir).model_path),
            tensors.items(),
            value_model=info["value_head"],
            vocab_size=info["vocab_size"],
        )
    )
    assert sorted(merged) == sorted(exported)
    for name, tensor in exported.items():
        assert torch.equal(merged[name], tensor), name


def _check_value_model(results: list[dict], path: str, vocab_size: int) -> None:
    batches = _batches(vocab_size, with_returns=True)[:2]
    expected_values = reference_values(path, batches[0]).values()
    reference = reference_train_losses(path, batches, OPTIMIZER, value_mse, model_type="value_model")
    for value in (r["value"] for r in results):
        _assert_exported_equal(value["exported"], path)
        _assert_curve(value["history"], reference)
        if value["values"] is not None:
            torch.testing.assert_close(value["values"]["values"], expected_values, atol=1e-5, rtol=0)

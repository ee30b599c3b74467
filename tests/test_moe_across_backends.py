"""Mixture-of-experts on Megatron with expert parallelism, against plain Hugging Face and the FSDP engine.

One 2-rank launch (gloo, fp32, the tiny Qwen3-MoE: 4 experts, top-2) at EP2, two experts per rank. Each rank
holds sequences ``rank`` and ``rank + 2`` of every batch, one per micro-batch, so the ranks' micro-batches hold
different token counts (7 and 8 tokens, then 7 and 7), which megatron's all-to-all token dispatcher exchanges:
- export equals the checkpoint's tensors bit for bit (experts gathered over the expert ranks, HF names);
- each rank's log-probs equal the plain HF model's on its sequences within 1e-5;
- a training step with the router balance loss (coefficient 0.5) gives the FSDP engine's loss, grad norm and
  ``router_aux_loss`` (the two ranks' shares summed) on the same batch (one FSDP rank, every sequence), and
  that term equals transformers' ``aux_loss`` of each sequence run alone, averaged (the per-sequence
  definition both backends share);
- an FSDP step (3 steps, saved) resumed at EP2 continues as 3 more uninterrupted FSDP steps (loss and grad norm
  within 1e-5 at every step): expert weights and Adam moments move through their Hugging Face names;
- router replay (R3) of routes chosen by a formula, unlike the live ones: each rank's log-probs equal a plain
  HF forward forced to them and the FSDP engine's replay of the same routes (1e-5), and a training step over
  them (after the balance-loss step) gives the FSDP engine's loss, grad norm and ``router_aux_loss``;
- and back: the EP2 run that resumed the FSDP step saves its step 6 (distributed optimizer: dense and expert moments in flat buckets of two
  data-parallel groups, mapped through the layout record), which one FSDP rank and one Megatron rank (EP1)
  each continue as 3 more uninterrupted steps.
"""

from __future__ import annotations

import pytest
import torch
from drivetrain_engine_core.backend import ModelConfig, OptimizerConfig
from drivetrain_engine_core.job import create_engine, engine_config_from_dict
from drivetrain_engine_core.kit import ROUTER_AUX_METRIC
from drivetrain_engine_core.testing import (
    forced_log_probs,
    formula_routes,
    load_reference_model,
    make_tiny_model_dir,
    random_batch,
    reference_log_probs,
    run_distributed,
    token_mean_nll,
    train_history,
    with_routes,
)
from safetensors.torch import load_file

pytestmark = pytest.mark.slow
pytest.importorskip("drivetrain_engine_fsdp")
pytest.importorskip("drivetrain_engine_megatron")

OPTIMIZER = OptimizerConfig(lr=1e-3, clip_grad=1.0, warmup_steps=2, weight_decay=0.01)
COEFFICIENT = 0.5  # large enough that the balance loss moves the grad norm well past the tolerance
SAVE_AT, STEPS, EP2_SAVE_AT = 3, 9, 6
EP2 = {"expert_model_parallel_size": 2, "micro_batch": {"micro_batch_size": 1}}


def _batches() -> list:
    return [
        random_batch(vocab_size=100, prompt_lengths=[3, 5, 2, 4], response_lengths=[4, 2, 6, 3], seed=seed)
        for seed in range(STEPS)
    ]


def _routed(batch):
    """``batch`` with a record for every sequence, chosen by a formula (4 experts, top-2, 2 layers)."""
    return with_routes(batch, [formula_routes(len(ids), 2, 4, 2) for ids in batch["input_ids"].unbind()])


def _replayed_log_probs(engine, batch):
    with engine.eval_mode():
        return engine.infer_batch(_routed(batch)).outputs["log_probs"]


def _shard(batch, rank: int):
    return batch[torch.tensor([rank, rank + 2])]


def _engine(backend: str, path: str, **engine: object):
    built = create_engine(
        model_config=ModelConfig(path=path),
        engine_config=engine_config_from_dict(
            {"backend": backend, "micro_batch": {"micro_batch_size": 2}, **engine}
        ),
        optimizer_config=OPTIMIZER,
    )
    built.initialize()
    return built


def _step_with_aux(engine, batch) -> tuple[float, float, float]:
    """``(loss, router_aux_loss summed over micro-batches, grad norm)`` of one training step."""
    with engine.train_mode():
        output = engine.train_batch(batch, token_mean_nll)
    return (
        float(output.loss),
        float(sum(output.metrics[ROUTER_AUX_METRIC])),
        float(output.metrics["grad_norm"]),
    )


def _expert_parallel(rank: int, world_size: int, path: str, fsdp_root: str, ep2_root: str) -> dict:
    del world_size
    batches = [_shard(batch, rank) for batch in _batches()]
    engine = _engine("megatron", path, router_aux_loss_coef=COEFFICIENT, **EP2)
    local_experts = sum(
        ".local_experts." in name for name, _ in engine._model.unwrapped[0].named_parameters()
    )
    exported = dict(engine.export_weights())
    with engine.eval_mode():
        log_probs = engine.infer_batch(batches[0]).outputs["log_probs"].values()
    replayed = _replayed_log_probs(engine, batches[0]).unbind()
    resumed = _engine("megatron", path, **EP2)
    extra = resumed.load_checkpoint(fsdp_root)
    continued = train_history(resumed, batches[SAVE_AT:EP2_SAVE_AT], token_mean_nll)
    resumed.save_checkpoint(ep2_root, global_step=EP2_SAVE_AT, extra_state={"position": EP2_SAVE_AT})
    return {
        "local_experts": local_experts,
        "exported": exported,
        "log_probs": log_probs,
        "aux_step": _step_with_aux(engine, batches[0]),
        "replayed": replayed,
        "replay_step": _step_with_aux(engine, _routed(batches[0])),
        "extra": extra,
        "continued": continued,
    }


def _transformers_aux(path: str, batch) -> float:
    """transformers' ``aux_loss`` (``load_balancing_loss_func``) of each sequence run alone, averaged."""
    model = load_reference_model(path)
    ids = batch["input_ids"]
    with torch.no_grad():
        values = [
            model(input_ids=ids[i].unsqueeze(0), output_router_logits=True).aux_loss
            for i in range(len(batch))
        ]
    return float(torch.stack(values).mean())


def test_expert_parallel_megatron_equals_hf_and_fsdp_and_resumes_fsdp_steps(tmp_path):
    path = str(make_tiny_model_dir(tmp_path / "model", arch="qwen3_moe"))
    batches = _batches()
    fsdp_aux = _engine("fsdp", path, router_aux_loss_coef=COEFFICIENT)
    fsdp_replayed = _replayed_log_probs(fsdp_aux, batches[0]).unbind()
    fsdp_aux_step = _step_with_aux(fsdp_aux, batches[0])
    fsdp_replay_step = _step_with_aux(fsdp_aux, _routed(batches[0]))
    fsdp = _engine("fsdp", path)
    reference = train_history(fsdp, batches[:SAVE_AT], token_mean_nll)
    fsdp.save_checkpoint(tmp_path / "fsdp", global_step=SAVE_AT, extra_state={"position": SAVE_AT})
    reference += train_history(fsdp, batches[SAVE_AT:], token_mean_nll)

    roots = (str(tmp_path / "fsdp"), str(tmp_path / "ep2"))
    results = run_distributed(_expert_parallel, path, *roots, world_size=2, timeout_s=900)
    for backend in ("fsdp", "megatron"):  # Megatron on one rank: EP1, the experts' optimizer not split
        back = _engine(backend, path)
        assert back.load_checkpoint(roots[1]) == {"global_step": EP2_SAVE_AT, "position": EP2_SAVE_AT}
        history = train_history(back, batches[EP2_SAVE_AT:], token_mean_nll)
        for step, (got, want) in enumerate(
            zip(history, reference[EP2_SAVE_AT:], strict=True), start=EP2_SAVE_AT + 1
        ):
            assert got == pytest.approx(want, rel=1e-5, abs=1e-6), (f"ep2 -> {backend}", step)

    # Each rank reports its micro-batches' shares of the balance loss: they sum to the step's value.
    shares = sum(result["aux_step"][1] for result in results)
    assert shares == pytest.approx(fsdp_aux_step[1], rel=1e-5)
    assert shares == pytest.approx(_transformers_aux(path, batches[0]), rel=1e-5)
    replay_shares = sum(result["replay_step"][1] for result in results)
    assert replay_shares == pytest.approx(fsdp_replay_step[1], rel=1e-5)
    model = load_reference_model(path)
    routed = _routed(batches[0])
    forced = [
        forced_log_probs(model, ids, routes)
        for ids, routes in zip(routed["input_ids"].unbind(), routed["routed_experts"].unbind(), strict=True)
    ]
    on_disk = load_file(f"{path}/model.safetensors")
    for rank, result in enumerate(results):
        assert result["local_experts"] == 2 * 2 * 2, (
            "two of the four experts (fc1, fc2) in each of two layers"
        )
        assert sorted(result["exported"]) == sorted(on_disk)
        for name, tensor in on_disk.items():
            assert torch.equal(result["exported"][name], tensor), (rank, name)
        expected = reference_log_probs(path, _shard(batches[0], rank)).values()
        assert float((result["log_probs"] - expected).abs().max()) < 1e-5, rank
        loss, _, norm = result["aux_step"]
        assert (loss, norm) == pytest.approx((fsdp_aux_step[0], fsdp_aux_step[2]), rel=1e-5), rank
        for got, index in zip(result["replayed"], (rank, rank + 2), strict=True):
            assert float((got[1:] - forced[index]).abs().max()) < 1e-5, (rank, index)
            assert float((got - fsdp_replayed[index]).abs().max()) < 1e-5, (rank, index)
        loss, _, norm = result["replay_step"]
        assert (loss, norm) == pytest.approx((fsdp_replay_step[0], fsdp_replay_step[2]), rel=1e-5), rank
        assert result["extra"] == {"global_step": SAVE_AT, "position": SAVE_AT}
        continued = zip(result["continued"], reference[SAVE_AT:EP2_SAVE_AT], strict=True)
        for step, (got, want) in enumerate(continued, start=SAVE_AT + 1):
            assert got == pytest.approx(want, rel=1e-5, abs=1e-6), (rank, step)

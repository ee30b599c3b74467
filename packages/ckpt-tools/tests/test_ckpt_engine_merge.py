"""Checkpoints written by the real FSDP engine (1 and 2 ranks; full, LoRA, value model) merge into Hugging Face
directories whose outputs match the engine's own within 1e-5 (fp32).

Each launch trains every variant one optimizer step (so the merged weights differ from the source model),
saves a checkpoint, and returns the engine's per-token outputs on a probe batch. The test process then merges
each step and scores the probe batch with plain transformers (and peft for adapter directories).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from drivetrain_ckpt_tools.merge import MergeOptions, merge_checkpoint, open_merger
from drivetrain_ckpt_tools.reference import reference_outputs
from drivetrain_ckpt_tools.verify import probe_sequences
from drivetrain_engine_core.testing.launcher import run_distributed

pytestmark = pytest.mark.slow

TOLERANCE = 1e-5
VARIANTS = {
    "lm": ("language_model", False),
    "lm_lora": ("language_model", True),
    "critic": ("value_model", False),
    "critic_lora": ("value_model", True),
}


def _train_save_and_probe(rank: int, world_size: int, work: str, names: list[str]) -> dict | None:
    """In each rank: for every variant, train one step, save a checkpoint and score the probe batch."""
    from drivetrain_engine_core.backend import ForwardOptions, LoraConfig, ModelConfig, OptimizerConfig
    from drivetrain_engine_core.job import create_engine, engine_config_from_dict, make_batch
    from drivetrain_engine_core.testing.batches import random_batch
    from drivetrain_engine_core.testing.losses import token_mean_nll, value_mse
    from drivetrain_engine_core.testing.models import make_tiny_model_dir

    results = {}
    for name in names:
        model_type, lora = VARIANTS[name]
        source = Path(work) / f"src_{model_type}"
        if rank == 0 and not source.exists():
            make_tiny_model_dir(source, model_type=model_type, seed=11)
        torch.distributed.barrier()
        engine = create_engine(
            model_config=ModelConfig(
                path=str(source), model_type=model_type, lora=LoraConfig(rank=4, alpha=8.0) if lora else None
            ),
            engine_config=engine_config_from_dict({"backend": "fsdp", "device": "cpu"}),
            optimizer_config=OptimizerConfig(lr=5e-2),
        )
        engine.initialize()
        critic = model_type == "value_model"
        batch = random_batch(
            vocab_size=100, prompt_lengths=[3, 5], response_lengths=[6, 4], seed=rank, with_returns=critic
        )
        with engine.train_mode():
            engine.train_batch(batch, value_mse if critic else token_mean_nll)
        engine.save_checkpoint(Path(work) / name, global_step=1)
        probe = make_batch(probe_sequences(100))
        with engine.eval_mode():
            outputs = engine.infer_batch(probe, options=ForwardOptions(compute_entropy=not critic)).outputs
        keys = ("values",) if critic else ("log_probs", "entropy")
        results[name] = {key: [t.clone() for t in outputs[key].unbind()] for key in keys}
    return results if rank == 0 else None


@pytest.fixture(scope="module")
def engine_steps(tmp_path_factory):
    """``{world_size: (work dir, engine outputs by variant)}`` for a 1-rank and a 2-rank launch."""
    launches = {}
    for world_size, names in ((1, ["lm", "lm_lora"]), (2, list(VARIANTS))):
        work = tmp_path_factory.mktemp(f"world{world_size}")
        outputs = run_distributed(
            _train_save_and_probe, str(work), names, world_size=world_size, timeout_s=400
        )[0]
        launches[world_size] = (work, outputs)
    return launches


def _max_diff(expected: dict, actual: dict) -> float:
    return max(
        float((a - e).abs().max())
        for key in expected
        for a, e in zip(actual[key], expected[key], strict=True)
    )


CASES = [
    (1, "lm", False),
    (1, "lm_lora", False),
    (1, "lm_lora", True),
    (2, "lm", False),
    (2, "lm_lora", False),
    (2, "lm_lora", True),
    (2, "critic", False),
    (2, "critic_lora", False),
    (2, "critic_lora", True),
]


@pytest.mark.parametrize(("world_size", "name", "merge_lora"), CASES)
def test_merged_outputs_match_the_engine(engine_steps, tmp_path, world_size, name, merge_lora):
    work, engine_outputs = engine_steps[world_size]
    step = work / name / "global_step_1"
    result = merge_checkpoint(step, tmp_path / "merged", MergeOptions(merge_lora=merge_lora))
    assert result.kind == ("adapter" if VARIANTS[name][1] and not merge_lora else "model")
    merger = open_merger(step)
    assert merger.manifest.world_size == world_size
    sequences = probe_sequences(100)
    merged = reference_outputs(tmp_path / "merged", merger, sequences)
    assert _max_diff(engine_outputs[name], merged) < TOLERANCE
    # The engine trained one step, so the source model must score differently: the merge used trained weights.
    untouched = reference_outputs(Path(merger.manifest.model_path), merger, sequences)
    assert _max_diff(engine_outputs[name], untouched) > 1e-4


def _cli_verify(rank: int, world_size: int, runs: list[list[str]]) -> list[tuple[int, str]]:
    """Run ``drivetrain ckpt verify`` commands in a launched process (the engine needs its process group)."""
    from click.testing import CliRunner
    from drivetrain_engine_core.job import build_cli

    runner = CliRunner()
    return [
        (r.exit_code, r.output)
        for r in (runner.invoke(build_cli(), ["ckpt", "verify", *args]) for args in runs)
    ]


def test_cli_verify_prints_the_difference_and_fails_on_the_wrong_checkpoint(engine_steps, tmp_path):
    (work1, _), (work2, _) = engine_steps[1], engine_steps[2]
    merge_checkpoint(work2 / "lm", tmp_path / "lm")
    merge_checkpoint(work2 / "critic_lora", tmp_path / "critic_adapter")
    runs = [
        [str(tmp_path / "lm"), "--against", str(work2 / "lm")],
        [str(tmp_path / "critic_adapter"), "--against", str(work2 / "critic_lora")],
        [str(tmp_path / "lm"), "--against", str(work1 / "lm")],  # another run's weights
    ]
    (ok_code, ok_out), (adapter_code, adapter_out), (bad_code, bad_out) = run_distributed(
        _cli_verify, runs, world_size=1, timeout_s=300
    )[0]
    assert ok_code == 0, ok_out
    assert re.search(r"max abs diff \S+ over 25 tokens \(log_probs \S+, entropy \S+\)", ok_out)
    assert float(re.search(r"max abs diff (\S+)", ok_out).group(1)) < TOLERANCE
    assert adapter_code == 0, adapter_out
    assert "values" in adapter_out
    assert bad_code == 1
    assert "exceeds the tolerance 1e-05" in bad_out


def test_ls_says_an_fsdp_optimizer_moves(engine_steps):
    """An FSDP step keeps one optimizer state per named parameter: ``ckpt ls`` reports it as moving."""
    from drivetrain_ckpt_tools.inspect import list_steps

    work, _ = engine_steps[2]
    (info,) = list_steps(work / "lm")
    assert (Path(info.path) / "optimizer").is_dir()
    assert (info.optimizer, info.optimizer_moves) == ("per-parameter", True)

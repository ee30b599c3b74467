"""Checkpoints written by the Megatron engine at TP2 and PP2 (2 gloo ranks, fp32) merge into Hugging Face
directories whose outputs match the engine's own within 1e-5.

One launch per layout (a process holds one megatron layout): each variant trains one optimizer step, saves,
and returns the engine's per-token outputs on the probe batch; the test process merges and scores with plain
transformers.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from drivetrain_ckpt_tools.merge import merge_checkpoint, open_merger
from drivetrain_ckpt_tools.reference import reference_outputs
from drivetrain_ckpt_tools.verify import probe_sequences
from drivetrain_engine_core.testing.launcher import run_distributed

pytest.importorskip("drivetrain_engine_megatron.merger")
pytestmark = pytest.mark.slow

TOLERANCE = 1e-5
VARIANTS = {
    "tp2": ("qwen2", "language_model", {"tensor_model_parallel_size": 2}),
    "tp2_critic": ("qwen2", "value_model", {"tensor_model_parallel_size": 2}),
    "pp2": ("llama", "language_model", {"pipeline_model_parallel_size": 2}),
}
LAUNCHES = (["tp2", "tp2_critic"], ["pp2"])


def _train_save_and_probe(rank: int, world_size: int, work: str, names: list[str]) -> dict:
    """In each rank: for every variant, train one step, save a checkpoint and score the probe batch."""
    from drivetrain_engine_core.backend import ForwardOptions, ModelConfig, OptimizerConfig
    from drivetrain_engine_core.job import MicroBatchConfig, make_batch
    from drivetrain_engine_core.testing import make_tiny_model_dir, random_batch, token_mean_nll, value_mse
    from drivetrain_engine_megatron.config import MegatronEngineConfig
    from drivetrain_engine_megatron.engine import MegatronEngine

    results = {}
    for name in names:
        arch, model_type, layout = VARIANTS[name]
        source = Path(work) / f"src_{name}"
        if rank == 0:
            make_tiny_model_dir(source, arch=arch, model_type=model_type, seed=5)
        torch.distributed.barrier()
        engine = MegatronEngine(
            model_config=ModelConfig(path=str(source), model_type=model_type),
            engine_config=MegatronEngineConfig(micro_batch=MicroBatchConfig(micro_batch_size=1), **layout),
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
        if outputs is not None:  # the output rank (last pipeline stage)
            keys = ("values",) if critic else ("log_probs", "entropy")
            results[name] = {key: [t.clone() for t in outputs[key].unbind()] for key in keys}
    return results


@pytest.fixture(scope="module")
def megatron_steps(tmp_path_factory):
    """``(work dir, engine outputs by variant)`` after one launch per layout."""
    work = tmp_path_factory.mktemp("megatron")
    outputs: dict = {}
    for names in LAUNCHES:
        for rank_result in run_distributed(
            _train_save_and_probe, str(work), names, world_size=2, timeout_s=500
        ):
            outputs.update(rank_result)
    return work, outputs


def _max_diff(expected: dict, actual: dict) -> float:
    return max(
        float((a - e).abs().max())
        for key in expected
        for a, e in zip(actual[key], expected[key], strict=True)
    )


@pytest.mark.parametrize("name", list(VARIANTS))
def test_megatron_merge_matches_the_engine(megatron_steps, tmp_path, name):
    work, engine_outputs = megatron_steps
    step = work / name / "global_step_1"
    merge_checkpoint(step, tmp_path / "merged")
    merger = open_merger(step)
    assert merger.manifest.backend == "megatron"
    sequences = probe_sequences(100)
    assert (
        _max_diff(engine_outputs[name], reference_outputs(tmp_path / "merged", merger, sequences)) < TOLERANCE
    )
    # One optimizer step was taken: the source model must score differently.
    source = reference_outputs(Path(merger.manifest.model_path), merger, sequences)
    assert _max_diff(engine_outputs[name], source) > 1e-4


def test_ls_shows_the_optimizer_and_whether_it_moves(megatron_steps, tmp_path):
    """``ckpt ls`` reports a distributed-optimizer step as moving exactly when its save wrote the layout record
    (the ``optimizer_layout/`` files), and one without the record (a save by an older version) as staying."""
    from click.testing import CliRunner
    from drivetrain_engine_core.job import build_cli
    from drivetrain_engine_core.kit import read_manifest

    work, _ = megatron_steps
    recorded = work / "tp2"
    old_version = tmp_path / "old"
    shutil.copytree(recorded, old_version)
    shutil.rmtree(old_version / "global_step_1" / "optimizer_layout")
    moves = []
    for root in (recorded, old_version):
        step = root / "global_step_1"
        listed = CliRunner().invoke(build_cli(), ["ckpt", "ls", str(root), "--json"])
        (info,) = json.loads(listed.output)
        distributed = read_manifest(step).backend_info["use_distributed_optimizer"]
        assert info["optimizer"] == ("distributed" if distributed else "per-parameter")
        assert info["optimizer_moves"] == (step / "optimizer_layout").is_dir()
        moves.append(info["optimizer_moves"])
        table = CliRunner().invoke(build_cli(), ["ckpt", "ls", str(root)]).output
        assert (
            f"optimizer: distributed, moves to other backends and layouts: {'yes' if info['optimizer_moves'] else 'no'}"
            in table
        )
    assert moves == [True, False]

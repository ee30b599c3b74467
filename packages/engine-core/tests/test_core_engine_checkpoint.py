"""Checkpoint layout written by the base ``Engine``: temporary directory, manifest last, ``latest``, pruning
only after publication, and errors that name the broken file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from drivetrain_engine_core.backend import CheckpointError, ModelConfig, OptimizerConfig
from drivetrain_engine_core.job import MANIFEST_FILE, CheckpointConfig, resolve_step_dir
from drivetrain_engine_core.testing.batches import random_batch
from drivetrain_engine_core.testing.losses import token_mean_nll
from drivetrain_engine_core.testing.tiny_engine import TinyEngineConfig, TinyTorchEngine

VOCAB = 64
OPTIMIZER = OptimizerConfig(lr=0.1, warmup_steps=3)


class RecordingEngine(TinyTorchEngine):
    """Records where the backend is asked to write, and can fail mid-save like a crashed job."""

    fail_save = False

    def _save_checkpoint(self, step_dir: Path, *, save_optimizer: bool) -> None:
        self.calls.append(("save", step_dir.name, str((step_dir / MANIFEST_FILE).exists())))
        if self.fail_save:
            raise OSError("disk full")
        super()._save_checkpoint(step_dir, save_optimizer=save_optimizer)


def make_engine(max_ckpt_to_keep: int | None = None, *, save_optimizer: bool = True) -> RecordingEngine:
    engine = RecordingEngine(
        model_config=ModelConfig(path="tiny-model"),
        engine_config=TinyEngineConfig(vocab_size=VOCAB),
        optimizer_config=OPTIMIZER,
        checkpoint_config=CheckpointConfig(max_ckpt_to_keep=max_ckpt_to_keep, save_optimizer=save_optimizer),
    )
    engine.initialize()
    return engine


def train_step(engine: TinyTorchEngine, seed: int) -> tuple[float, float]:
    batch = random_batch(vocab_size=VOCAB, prompt_lengths=[2, 3], response_lengths=[4, 2], seed=seed)
    with engine.train_mode():
        output = engine.train_batch(batch, token_mean_nll)
    engine.lr_scheduler_step()
    return output.loss, output.metrics["grad_norm"]


def files_under(path: Path) -> set[str]:
    return {p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()}


def test_step_is_written_under_a_temporary_name_and_the_manifest_last(tmp_path: Path) -> None:
    engine = make_engine()
    train_step(engine, seed=0)
    published = engine.save_checkpoint(tmp_path, global_step=7)
    assert ("save", ".tmp-global_step_7", "False") in engine.calls  # backend wrote before any manifest
    assert published == tmp_path / "global_step_7"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_7", "latest"]
    assert (tmp_path / "latest").read_text() == "global_step_7"
    manifest = json.loads((published / MANIFEST_FILE).read_text())
    assert set(manifest["files"]) == files_under(published) - {MANIFEST_FILE}
    assert set(manifest["files"]) == {
        "model/model.pt",
        "optimizer/optimizer.pt",
        "extra/state.json",
        "extra/rng_rank0.pt",
    }
    assert (manifest["backend"], manifest["global_step"], manifest["world_size"]) == ("tiny", 7, 1)
    assert manifest["model_path"] == str(Path("tiny-model").resolve())
    # A model that needs its own code: a merge and `ckpt verify` pass the flag on (they could not load it).
    assert manifest["trust_remote_code"] is False


def test_pruning_happens_only_after_the_new_step_is_published(tmp_path: Path) -> None:
    engine = make_engine(max_ckpt_to_keep=2)
    for step in (1, 2, 3):
        engine.save_checkpoint(tmp_path, global_step=step)
    assert sorted(p.name for p in tmp_path.glob("global_step_*")) == ["global_step_2", "global_step_3"]
    engine.fail_save = True
    with pytest.raises(OSError, match="disk full"):
        engine.save_checkpoint(tmp_path, global_step=4)
    assert sorted(p.name for p in tmp_path.glob("global_step_*")) == ["global_step_2", "global_step_3"]
    assert resolve_step_dir(tmp_path) == tmp_path / "global_step_3"
    engine.fail_save = False
    engine.save_checkpoint(tmp_path, global_step=4, max_ckpt_to_keep=1)
    assert sorted(p.name for p in tmp_path.glob("global_step_*")) == ["global_step_4"]
    assert not list(tmp_path.glob(".tmp-*"))


def test_round_trip_restores_weights_optimizer_schedule_rng_and_extra_state(tmp_path: Path) -> None:
    engine = make_engine()
    train_step(engine, seed=0)
    engine.skips.skipped_steps, engine.skips.consecutive_skips = (
        2,
        1,
    )  # two updates skipped, the last one in a row
    engine.save_checkpoint(tmp_path, global_step=1, extra_state={"data_position": 12})
    after_save = torch.rand(3)
    expected = train_step(engine, seed=1)
    resumed = make_engine()
    assert resumed.load_checkpoint(tmp_path) == {"global_step": 1, "data_position": 12}
    assert torch.equal(torch.rand(3), after_save)
    assert (
        resumed.skipped_steps == 2 and resumed.skips.consecutive_skips == 1
    )  # max_consecutive_skips spans it
    assert resumed.current_lr == pytest.approx(0.1 * 2 / 3)  # warm-up step 1 of 3
    assert train_step(resumed, seed=1) == expected
    assert all(
        torch.equal(a, b)
        for (_, a), (_, b) in zip(engine.export_weights(), resumed.export_weights(), strict=True)
    )


def saved_step(tmp_path: Path) -> tuple[RecordingEngine, Path]:
    engine = make_engine()
    train_step(engine, seed=0)
    return engine, engine.save_checkpoint(tmp_path, global_step=1)


def test_corrupt_file_is_named(tmp_path: Path) -> None:
    engine, step = saved_step(tmp_path)
    shard = step / "model" / "model.pt"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"{shard}.*SHA-256.*corrupt"):
        engine.load_checkpoint(step)


def test_a_damaged_latest_step_names_the_way_back_to_an_earlier_one(tmp_path: Path) -> None:
    """The error said only "it is corrupt", leaving a user to find out how to resume from an earlier step; it
    now names the listing command and the deletion, and following it resumes from the step before."""
    engine = make_engine()
    train_step(engine, seed=0)
    engine.save_checkpoint(tmp_path, global_step=1, extra_state={"data_position": 1})
    train_step(engine, seed=1)
    latest = engine.save_checkpoint(tmp_path, global_step=2, extra_state={"data_position": 2})
    (latest / "model" / "model.pt").write_bytes(b"torn")
    resumed = make_engine()
    with pytest.raises(CheckpointError) as failure:
        resumed.load_checkpoint(tmp_path)
    assert f"`drivetrain ckpt ls {tmp_path} --check` lists the intact ones" in str(failure.value)
    assert f"once {latest} is deleted, --resume continues from the newest remaining one" in str(failure.value)
    shutil.rmtree(latest)
    assert resumed.load_checkpoint(tmp_path) == {"global_step": 1, "data_position": 1}


def test_truncated_file_is_named(tmp_path: Path) -> None:
    engine, step = saved_step(tmp_path)
    shard = step / "optimizer" / "optimizer.pt"
    shard.write_bytes(shard.read_bytes()[:10])
    with pytest.raises(CheckpointError, match=rf"{shard} has 10 bytes.*truncated"):
        engine.load_checkpoint(tmp_path)


def test_missing_file_and_missing_manifest_are_named(tmp_path: Path) -> None:
    engine, step = saved_step(tmp_path)
    (step / "extra" / "state.json").unlink()
    with pytest.raises(CheckpointError, match=rf"{step / 'extra' / 'state.json'} is missing"):
        engine.load_checkpoint(step)
    (step / MANIFEST_FILE).unlink()
    with pytest.raises(CheckpointError, match=rf"{step / MANIFEST_FILE} does not exist.*incomplete"):
        engine.load_checkpoint(step)
    with pytest.raises(CheckpointError, match=r"no checkpoint to load.*Complete steps there: none"):
        engine.load_checkpoint(tmp_path)


def test_another_backends_checkpoint_is_refused(tmp_path: Path) -> None:
    engine, step = saved_step(tmp_path)
    manifest = json.loads((step / MANIFEST_FILE).read_text())
    (step / MANIFEST_FILE).write_text(json.dumps({**manifest, "backend": "megatron"}))
    with pytest.raises(CheckpointError, match="written by the 'megatron' backend; this engine is 'tiny'"):
        engine.load_checkpoint(step)


def test_extra_state_that_is_not_json_fails_before_anything_is_written(tmp_path: Path) -> None:
    engine = make_engine()
    with pytest.raises(TypeError, match="extra_state must be JSON-serialisable"):
        engine.save_checkpoint(tmp_path, global_step=1, extra_state={"sampler": object()})
    assert not tmp_path.exists() or not list(tmp_path.iterdir())
    assert not [c for c in engine.calls if c[0] == "save"]


def test_a_step_without_optimizer_state_cannot_resume_training_and_says_so(tmp_path: Path) -> None:
    """A step saved with ``checkpoint.save_optimizer=false`` failed a resume with a backend's
    FileNotFoundError (a traceback from the CLI); it is now one CheckpointError naming both ways on."""
    engine = make_engine(save_optimizer=False)
    train_step(engine, seed=1)
    step = engine.save_checkpoint(tmp_path, global_step=1)
    resumed = make_engine()
    with pytest.raises(CheckpointError, match=r"holds no optimizer state.*load_optimizer=False.*ckpt merge"):
        resumed.load_checkpoint(step)
    assert resumed.load_checkpoint(step, load_optimizer=False)["global_step"] == 1


def test_the_manifest_records_that_the_model_needs_its_own_code(tmp_path: Path) -> None:
    from drivetrain_engine_core.kit import read_manifest

    engine = RecordingEngine(
        model_config=ModelConfig(path="tiny-model", trust_remote_code=True),
        engine_config=TinyEngineConfig(vocab_size=VOCAB),
        optimizer_config=OPTIMIZER,
    )
    engine.initialize()
    assert read_manifest(engine.save_checkpoint(tmp_path, global_step=1)).trust_remote_code is True

"""Damaged or unusable inputs are refused with one message naming the file, and leave nothing behind."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from drivetrain_ckpt_tools.hf_files import SIDE_FILES
from drivetrain_ckpt_tools.merge import MergeOptions, merge_checkpoint
from drivetrain_engine_core.backend import CheckpointError


def _largest_shard(step):
    return max((step / "model").glob("*.distcp"), key=lambda p: p.stat().st_size)


def _assert_nothing_written(parent, expected):
    assert sorted(p.name for p in parent.iterdir()) == sorted(expected)


def test_truncated_shard_is_refused_and_names_the_file(synthetic_step, tmp_path):
    shard = _largest_shard(synthetic_step)
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=f"{shard.name} has {len(data) // 2} bytes.*truncated"):
        merge_checkpoint(synthetic_step, tmp_path / "hf")
    _assert_nothing_written(tmp_path, ["ckpt"])


def test_missing_shard_is_refused_and_names_the_file(synthetic_step, tmp_path):
    shard = _largest_shard(synthetic_step)
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"{shard.name} is missing"):
        merge_checkpoint(synthetic_step, tmp_path / "hf")
    _assert_nothing_written(tmp_path, ["ckpt"])


def test_checksum_mismatch_is_refused_unless_checksums_are_skipped(synthetic_step, tmp_path):
    shard = _largest_shard(synthetic_step)
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0xFF  # same size, different content
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"{shard.name} does not match its SHA-256"):
        merge_checkpoint(synthetic_step, tmp_path / "hf")
    _assert_nothing_written(tmp_path, ["ckpt"])


def test_missing_manifest_is_an_incomplete_step(synthetic_step, tmp_path):
    (synthetic_step / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match=r"manifest\.json does not exist.*incomplete"):
        merge_checkpoint(synthetic_step, tmp_path / "hf")
    _assert_nothing_written(tmp_path, ["ckpt"])


def test_existing_destination_is_refused_then_replaced_with_overwrite(synthetic_step, tmp_path):
    destination = tmp_path / "hf"
    destination.mkdir()
    (destination / "keep.txt").write_text("mine")
    with pytest.raises(CheckpointError, match=f"destination {destination} already exists.*--overwrite"):
        merge_checkpoint(synthetic_step, destination)
    assert (destination / "keep.txt").read_text() == "mine"
    _assert_nothing_written(tmp_path, ["ckpt", "hf"])

    merge_checkpoint(synthetic_step, destination, MergeOptions(overwrite=True))
    assert not (destination / "keep.txt").exists()
    assert (destination / "model.safetensors").is_file()
    _assert_nothing_written(tmp_path, ["ckpt", "hf"])


def test_failure_while_writing_removes_the_staging_directory(synthetic_step, tmp_path, monkeypatch):
    """A merge that fails after it started writing (here: the source config vanished) leaves no partial output."""
    import drivetrain_ckpt_tools.merge as merge_module

    def broken(merger, directory, dtype):
        (directory / "partial.bin").write_bytes(b"x")
        raise CheckpointError("config went away")

    monkeypatch.setattr(merge_module, "write_model_config", broken)
    with pytest.raises(CheckpointError, match="config went away"):
        merge_checkpoint(synthetic_step, tmp_path / "hf")
    _assert_nothing_written(tmp_path, ["ckpt"])


def test_unknown_backend_names_what_is_installed(synthetic_step, tmp_path):
    from drivetrain_engine_core._checkpoint import write_manifest
    from drivetrain_engine_core.backend import PluginError
    from drivetrain_engine_core.job import Manifest
    from drivetrain_engine_core.kit import read_manifest

    manifest = read_manifest(synthetic_step)
    write_manifest(synthetic_step, Manifest(**{**manifest.__dict__, "backend": "deepspeed"}))
    with pytest.raises(PluginError, match=r"deepspeed.*fsdp"):
        merge_checkpoint(synthetic_step, tmp_path / "hf")
    _assert_nothing_written(tmp_path, ["ckpt"])


def _link_to_a_secret(side_file: Path, tmp_path: Path) -> None:
    """Replace ``side_file`` by a symlink to a file outside the model directory, which a merge must not copy."""
    secret = tmp_path / "secret"
    secret.write_text("do not publish")
    side_file.unlink(missing_ok=True)
    side_file.symlink_to(secret)


def test_only_allow_listed_regular_side_files_travel(write_step, source_dir, source_model, tmp_path):
    planted = tmp_path / "model"
    shutil.copytree(source_dir, planted)
    (planted / "id_rsa").write_text("-----BEGIN OPENSSH PRIVATE KEY-----")
    (planted / "notes.txt").write_text("internal")
    _link_to_a_secret(planted / "generation_config.json", tmp_path)
    step = write_step(tmp_path / "ckpt", 5, source_model, model_path=planted)
    result = merge_checkpoint(step, tmp_path / "hf")
    assert not {"id_rsa", "notes.txt", "generation_config.json"} & set(result.files)
    assert {"tokenizer.json", "tokenizer_config.json", "config.json", "model.safetensors"} <= set(
        result.files
    )
    assert set(result.files) - {"config.json", "model.safetensors"} <= SIDE_FILES


def test_destination_that_contains_the_checkpoint_is_refused(synthetic_step, tmp_path):
    run = synthetic_step.parent.parent
    for destination in (run, synthetic_step.parent, synthetic_step):
        with pytest.raises(
            CheckpointError, match=r"contains the checkpoint, .* writing there would delete it"
        ):
            merge_checkpoint(synthetic_step.parent, destination, MergeOptions(overwrite=True))
    assert (synthetic_step / "manifest.json").is_file()


def test_destination_that_holds_the_source_model_is_refused(write_step, source_dir, source_model, tmp_path):
    """``ckpt merge lora-ckpts/ /models/Qwen --overwrite`` replaced the base model (which every step of the run
    needs to be merged and loaded) with the merge's output."""
    model = tmp_path / "models" / "base"
    shutil.copytree(source_dir, model)
    step = write_step(tmp_path / "ckpt", 5, source_model, model_path=model)
    for destination in (model, model.parent):
        with pytest.raises(CheckpointError, match=r"contains the model the checkpoint starts from"):
            merge_checkpoint(step, destination, MergeOptions(overwrite=True))
    assert sorted(p.name for p in model.iterdir()) == sorted(p.name for p in source_dir.iterdir())


def test_a_killed_merges_staging_copy_is_removed_by_the_next_merge(synthetic_step, tmp_path):
    """A merge writes ``.<dst>.tmp-<pid>`` and renames it; a killed merge left the full-size hidden copy behind,
    and every later merge used another pid."""
    dead = tmp_path / ".hf.tmp-999999999"  # beyond any pid_max
    live = tmp_path / f".hf.tmp-{os.getppid()}"
    dead.mkdir()
    live.mkdir()
    merge_checkpoint(synthetic_step, tmp_path / "hf")
    assert not dead.exists() and live.exists()


def test_side_files_of_a_hugging_face_cache_snapshot_travel(write_step, source_dir, source_model, tmp_path):
    """A model path in the Hugging Face cache holds symlinks into its repository's ``blobs/`` (regression: every
    symlink was skipped, so a merge from a cached model came out without its tokenizer); a snapshot link that
    points elsewhere is still skipped."""
    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for entry in source_dir.iterdir():
        blob = blobs / f"sha-{entry.name}"
        shutil.copyfile(entry, blob)
        (snapshot / entry.name).symlink_to(Path("..") / ".." / "blobs" / blob.name)
    _link_to_a_secret(snapshot / "generation_config.json", tmp_path)
    step = write_step(tmp_path / "ckpt", 5, source_model, model_path=snapshot)
    result = merge_checkpoint(step, tmp_path / "hf")
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(result.files)
    assert "generation_config.json" not in result.files
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == (source_dir / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("where", ["a later probe sequence", "the entropy"])
def test_verify_fails_a_merged_model_with_nan_outputs(synthetic_step, tmp_path, monkeypatch, where):
    """Python's ``max`` keeps only a NaN that comes first, so NaN in the second or third probe sequence, or in
    the entropy (compared after the log-probs), passed verification with a difference of 0."""
    import drivetrain_ckpt_tools.verify as verify

    def zeros(sequences):
        return {key: [torch.zeros(len(s)) for s in sequences] for key in ("log_probs", "entropy")}

    def merged_outputs(directory, merger, sequences, device):
        outputs = zeros(sequences)
        if where == "the entropy":
            outputs["entropy"][0][:] = float("nan")
        else:
            outputs["log_probs"][1][3] = float("nan")
        return outputs

    monkeypatch.setattr(verify, "reference_outputs", merged_outputs)
    monkeypatch.setattr(verify, "engine_outputs", lambda merger, sequences, device, plugins: zeros(sequences))
    merge_checkpoint(synthetic_step, tmp_path / "merged")
    result = verify.verify_merged(tmp_path / "merged", synthetic_step)
    assert result.max_abs_diff == float("inf") and not result.passed


def test_a_checkpoint_whose_model_moved_merges_with_model_path(
    write_step, source_dir, source_model, tmp_path
):
    """The manifest records the source model's absolute path; a checkpoint copied to another machine could not
    be merged, and the error suggested pointing the merge at a copy with no option to do so (verl's merger has
    ``--hf_model_path``)."""
    from transformers import AutoModelForCausalLM

    trained_from = tmp_path / "cluster_a" / "model"
    shutil.copytree(source_dir, trained_from)
    step = write_step(tmp_path / "ckpt", 5, source_model, model_path=trained_from)
    moved = tmp_path / "cluster_b" / "model"
    shutil.move(trained_from, moved)
    with pytest.raises(CheckpointError, match=r"pass a copy of it with `--model-path DIR`"):
        merge_checkpoint(step, tmp_path / "hf")
    merge_checkpoint(step, tmp_path / "hf", MergeOptions(model_path=str(moved)))
    assert (tmp_path / "hf" / "tokenizer.json").is_file()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).state_dict()
    assert all(torch.equal(merged[name], value) for name, value in source_model.state_dict().items())


def test_the_remote_code_the_configs_name_travels(write_step, source_dir, source_model, tmp_path):
    """A ``trust_remote_code`` model's config keeps its ``auto_map``, but its ``modeling_*.py`` files stayed
    behind (``save_pretrained`` copies them), so the merged directory did not load. Only the modules the
    ``auto_map`` entries name travel, and none from another repository (``repo--module.Class``)."""
    import json

    planted = tmp_path / "model"
    shutil.copytree(source_dir, planted)
    config = json.loads((planted / "config.json").read_text())
    config["auto_map"] = {
        "AutoConfig": "configuration_tiny.TinyConfig",
        "AutoModelForCausalLM": "modeling_tiny.TinyForCausalLM",
        "AutoModel": "org/other--modeling_other.OtherModel",
    }
    (planted / "config.json").write_text(json.dumps(config))
    tokenizer_config = json.loads((planted / "tokenizer_config.json").read_text())
    tokenizer_config["auto_map"] = {"AutoTokenizer": ["tokenization_tiny.TinyTokenizer", None]}
    (planted / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    for name in (
        "configuration_tiny.py",
        "modeling_tiny.py",
        "tokenization_tiny.py",
        "modeling_other.py",
        "x.py",
    ):
        (planted / name).write_text("# code\n")
    step = write_step(tmp_path / "ckpt", 5, source_model, model_path=planted)
    files = set(merge_checkpoint(step, tmp_path / "hf").files)
    assert {f for f in files if f.endswith(".py")} == {
        "configuration_tiny.py",
        "modeling_tiny.py",
        "tokenization_tiny.py",
    }


def test_verify_of_a_directory_it_cannot_load_is_one_error(synthetic_step, tmp_path):
    """transformers', peft's and torch's refusals (peft missing, a device this machine lacks, another model's
    adapter) reached the CLI as tracebacks: ``verify`` catches only drivetrain's errors."""
    from drivetrain_ckpt_tools.merge import open_merger
    from drivetrain_ckpt_tools.reference import load_merged

    merge_checkpoint(synthetic_step, tmp_path / "hf")
    with pytest.raises(
        CheckpointError, match=r"cannot load .*hf on nodevice: .*Check that it was merged from"
    ):
        load_merged(tmp_path / "hf", open_merger(synthetic_step), device="nodevice")

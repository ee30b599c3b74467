"""``drivetrain ckpt ls`` and ``merge`` through the real CLI (click runner, plugins discovered from entry points)."""

from __future__ import annotations

import json
import shutil

from click.testing import CliRunner
from drivetrain_engine_core.job import build_cli


def _run(*args: str):
    return CliRunner().invoke(build_cli(), ["ckpt", *args])


def test_ls_lists_complete_and_incomplete_steps(synthetic_step, tmp_path):
    root = synthetic_step.parent
    broken = root / "global_step_9"
    shutil.copytree(synthetic_step, broken)
    (broken / "manifest.json").unlink()
    (root / "latest").write_text(synthetic_step.name)

    listed = _run("ls", str(root), "--json")
    assert listed.exit_code == 0, listed.output
    steps = {s["global_step"]: s for s in json.loads(listed.output)}
    assert steps[5]["complete"] and steps[5]["latest"]
    assert (steps[5]["backend"], steps[5]["world_size"], steps[5]["model_type"]) == (
        "fsdp",
        1,
        "language_model",
    )
    assert steps[5]["contents"] == ["manifest.json", "model"]
    assert (steps[5]["optimizer"], steps[5]["optimizer_moves"]) == (None, False)  # no optimizer/ saved
    assert not steps[9]["complete"]
    assert "no manifest.json" in steps[9]["problem"]

    table = _run("ls", str(root))
    assert table.exit_code == 0
    assert "complete*" in table.output and "BROKEN" in table.output
    assert "optimizer: none saved" in table.output


def test_ls_skips_a_step_a_running_job_moves_while_it_is_read(synthetic_step, monkeypatch):
    """Publishing renames ``.tmp-`` steps into place and pruning moves old ones aside; ``ls`` under ``watch``
    beside a running job met a step that vanished between the listing and its ``stat`` and printed a traceback."""
    from drivetrain_ckpt_tools import inspect

    root = synthetic_step.parent
    shutil.copytree(synthetic_step, root / "global_step_3")
    real = inspect._describe

    def pruned_meanwhile(entry, *args):
        if entry.global_step == 3:
            shutil.rmtree(entry.path)
        return real(entry, *args)

    monkeypatch.setattr(inspect, "_describe", pruned_meanwhile)
    listed = _run("ls", str(root), "--json")
    assert listed.exit_code == 0, listed.output
    assert [s["global_step"] for s in json.loads(listed.output)] == [5]


def test_ls_check_finds_a_corrupt_file(synthetic_step):
    shard = next((synthetic_step / "model").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-1])
    result = _run("ls", str(synthetic_step.parent), "--json", "--check")
    listed = json.loads(result.stdout)
    assert not listed[0]["complete"] and listed[0]["damaged"]
    assert shard.name in listed[0]["problem"]
    # A check that cannot fail a script is no check: the exit status says so, naming the step and the file.
    assert result.exit_code == 1
    assert "step 5" in result.stderr and shard.name in result.stderr
    assert "Traceback" not in result.output


def test_ls_check_passes_an_intact_root_with_an_interrupted_save(synthetic_step):
    """An interrupted save (no manifest) is what a running job leaves behind, not damage: exit status 0."""
    interrupted = synthetic_step.parent / "global_step_9"
    shutil.copytree(synthetic_step, interrupted)
    (interrupted / "manifest.json").unlink()
    result = _run("ls", str(synthetic_step.parent), "--check")
    assert result.exit_code == 0, result.output
    assert "BROKEN" in result.output


def test_merge_command_writes_sharded_model(synthetic_step, tmp_path):
    result = _run("merge", str(synthetic_step), str(tmp_path / "hf"), "--max-shard-size", "50KB")
    assert result.exit_code == 0, result.output
    assert "(model:" in result.output
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1


def test_merge_command_errors_are_one_line_without_traceback(synthetic_step, tmp_path):
    (tmp_path / "hf").mkdir()
    result = _run("merge", str(synthetic_step), str(tmp_path / "hf"))
    assert result.exit_code == 1
    assert "already exists" in result.output and "--overwrite" in result.output
    assert "Traceback" not in result.output

    bad_size = _run("merge", str(synthetic_step), str(tmp_path / "other"), "--max-shard-size", "lots")
    assert bad_size.exit_code == 1
    assert "'lots' is not a size" in bad_size.output
    assert not (tmp_path / "other").exists()


def test_ls_recognises_the_copy_an_interrupted_resave_left_aside(synthetic_step):
    root = synthetic_step.parent
    shutil.copytree(synthetic_step, root / ".tmp-global_step_5")  # the new copy, complete but not renamed in
    synthetic_step.rename(root / ".old-global_step_5")
    (root / "latest").write_text("global_step_5")

    steps = json.loads(_run("ls", str(root), "--json").output)
    by_path = {s["path"].rsplit("/", 1)[-1]: s for s in steps}
    aside, pending = by_path[".old-global_step_5"], by_path[".tmp-global_step_5"]
    assert (aside["kind"], aside["complete"], aside["problem"], aside["backend"]) == (
        "aside",
        True,
        None,
        "fsdp",
    )
    assert (pending["kind"], pending["complete"]) == ("temporary", False)
    assert "never published" in pending["problem"]
    assert " aside " in _run("ls", str(root)).output


def test_ls_shows_the_layout_that_wrote_a_step(write_step, source_model, source_dir, tmp_path):
    megatron = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1, "vocab_size": 110}
    info = {**megatron, "virtual_pipeline_model_parallel_size": None, "use_distributed_optimizer": False}
    step = write_step(
        tmp_path / "ckpt",
        3,
        source_model,
        model_path=source_dir,
        world_size=4,
        backend="megatron",
        backend_info=info,
    )

    listed = _run("ls", str(step.parent), "--json")
    assert json.loads(listed.output)[0]["layout"] == {
        "world_size": 4,
        "pipeline_model_parallel_size": 1,
        "tensor_model_parallel_size": 2,
        "use_distributed_optimizer": False,
    }
    table = _run("ls", str(step.parent))
    assert (
        "layout: world=4 pipeline_model_parallel=1 tensor_model_parallel=2 use_distributed_optimizer=False"
        in (table.output)
    )

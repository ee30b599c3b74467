"""Publication, resolution and pruning of checkpoint steps under interruptions: the last complete step always
resolves, a re-save or a prune is never a moment with nothing loadable, ``latest`` never leaves the root, and
everything is fsynced in an order that survives a power loss. Faults are injected at named points."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from drivetrain_engine_core._checkpoint import durable, set_fault_hook
from drivetrain_engine_core.backend import CheckpointError, ModelConfig, OptimizerConfig
from drivetrain_engine_core.job import MANIFEST_FILE, CheckpointConfig, complete_steps, resolve_step_dir
from drivetrain_engine_core.testing.tiny_engine import TinyEngineConfig, TinyTorchEngine


class Killed(Exception):
    """Stands for the process dying at a named point (the subprocess test in tests/ uses os._exit)."""


@pytest.fixture
def kill_at() -> Iterator[object]:
    def install(point: str) -> None:
        def hook(reached: str) -> None:
            if reached == point:
                raise Killed(point)

        set_fault_hook(hook)

    yield install
    set_fault_hook(None)


def make_engine(keep: int | None = None) -> TinyTorchEngine:
    engine = TinyTorchEngine(
        model_config=ModelConfig(path="tiny-model"),
        engine_config=TinyEngineConfig(vocab_size=16, hidden_size=4),
        optimizer_config=OptimizerConfig(lr=0.1),
        checkpoint_config=CheckpointConfig(max_ckpt_to_keep=keep),
    )
    engine.initialize()
    return engine


def names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_missing_or_dangling_latest_resolves_to_newest_complete_step(tmp_path, caplog):
    engine = make_engine()
    for step in (1, 2):
        engine.save_checkpoint(tmp_path, step)
    (tmp_path / "latest").unlink()  # an interrupted first save: complete step, no pointer yet
    with caplog.at_level(logging.WARNING):
        assert resolve_step_dir(tmp_path) == tmp_path / "global_step_2"
    assert "'latest' is missing; using the newest complete step instead: global_step_2" in caplog.text
    (tmp_path / "latest").write_text("global_step_3")
    assert resolve_step_dir(tmp_path) == tmp_path / "global_step_2"
    assert "'latest' names global_step_3, which is not a complete step" in caplog.text
    shard = tmp_path / "global_step_2" / "model" / "model.pt"
    shard.write_bytes(shard.read_bytes()[:5])  # the newest step does not verify: the one before it is used
    assert resolve_step_dir(tmp_path) == tmp_path / "global_step_1"
    assert make_engine().load_checkpoint(tmp_path)["global_step"] == 1


@pytest.mark.parametrize("pointer", ["../outside", "/", "global_step_1/../../outside", "global_step_9"])
def test_latest_never_leaves_the_root(tmp_path, pointer):
    root, outside = tmp_path / "run" / "ckpt", tmp_path / "run" / "outside"
    engine = make_engine()
    engine.save_checkpoint(root, 1)
    engine.save_checkpoint(outside.parent / "elsewhere", 5)
    os.replace(outside.parent / "elsewhere" / "global_step_5", outside)  # a complete step outside the root
    (root / "global_step_9").symlink_to(outside, target_is_directory=True)
    (root / "latest").write_text(pointer)
    assert resolve_step_dir(root) == root / "global_step_1"


def test_interrupted_resave_keeps_a_complete_copy(tmp_path, kill_at):
    engine = make_engine()
    engine.save_checkpoint(tmp_path, 1)
    engine.save_checkpoint(tmp_path, 2)
    kill_at("old_step_aside")
    with pytest.raises(Killed):
        engine.save_checkpoint(tmp_path, 2)
    assert names(tmp_path) == [".old-global_step_2", ".tmp-global_step_2", "global_step_1", "latest"]
    assert resolve_step_dir(tmp_path) == tmp_path / ".old-global_step_2"
    assert complete_steps(tmp_path)[-1] == (2, tmp_path / ".old-global_step_2")
    assert make_engine().load_checkpoint(tmp_path)["global_step"] == 2
    set_fault_hook(None)
    engine.save_checkpoint(tmp_path, 2)  # the next save of that step cleans up
    assert names(tmp_path) == ["global_step_1", "global_step_2", "latest"]


def test_interrupted_prune_leaves_no_step_that_looks_complete(tmp_path, kill_at):
    engine = make_engine(keep=1)
    engine.save_checkpoint(tmp_path, 1)
    kill_at("step_invalidated")
    with pytest.raises(Killed):
        engine.save_checkpoint(tmp_path, 2)
    trash = [n for n in names(tmp_path) if n.startswith(".trash-")]
    assert len(trash) == 1 and (tmp_path / trash[0] / MANIFEST_FILE).is_file()
    assert complete_steps(tmp_path) == [(2, tmp_path / "global_step_2")]
    set_fault_hook(None)
    engine.save_checkpoint(tmp_path, 3)
    assert names(tmp_path) == ["global_step_3", "latest"]


def test_a_prune_that_cannot_delete_keeps_training_and_retries_at_the_next_save(
    tmp_path, monkeypatch, caplog
):
    """Deleting a pruned step is housekeeping after publication; a failure there (NFS: "Directory not empty")
    raised on rank 0 alone after a good save, and every later save failed at the same leftover."""
    import errno
    import shutil

    from drivetrain_engine_core._checkpoint import publish

    real = shutil.rmtree

    def busy(path, *args, **kwargs):
        raise OSError(errno.ENOTEMPTY, "Directory not empty", str(path))

    engine = make_engine(keep=1)
    engine.save_checkpoint(tmp_path, 1)
    monkeypatch.setattr(publish.shutil, "rmtree", busy)
    with caplog.at_level(logging.WARNING):
        engine.save_checkpoint(tmp_path, 2)
        engine.save_checkpoint(tmp_path, 3)
    assert complete_steps(tmp_path) == [(3, tmp_path / "global_step_3")]
    assert resolve_step_dir(tmp_path) == tmp_path / "global_step_3"
    assert "could not delete" in caplog.text and "Directory not empty" in caplog.text
    monkeypatch.setattr(publish.shutil, "rmtree", real)
    engine.save_checkpoint(tmp_path, 4)
    assert names(tmp_path) == ["global_step_4", "latest"]  # the leftovers went at the next save


def test_pruning_keeps_the_step_just_published_whatever_its_number(tmp_path):
    old_run = make_engine()
    for step in (100, 200):
        old_run.save_checkpoint(tmp_path, step)
    make_engine().save_checkpoint(tmp_path, 10, max_ckpt_to_keep=2)
    assert names(tmp_path) == ["global_step_10", "global_step_200", "latest"]
    make_engine().save_checkpoint(tmp_path, 20, max_ckpt_to_keep=1)
    assert names(tmp_path) == ["global_step_20", "latest"]
    assert resolve_step_dir(tmp_path) == tmp_path / "global_step_20"


def test_pruning_never_follows_a_symlinked_step(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    make_engine().save_checkpoint(elsewhere, 1)
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / "global_step_1").symlink_to(elsewhere / "global_step_1", target_is_directory=True)
    engine = make_engine(keep=1)
    engine.save_checkpoint(root, 2)
    engine.save_checkpoint(root, 3)
    assert names(root) == ["global_step_1", "global_step_3", "latest"]
    assert (elsewhere / "global_step_1" / MANIFEST_FILE).is_file()


def test_publication_is_fsynced_in_an_order_that_survives_power_loss(tmp_path, monkeypatch):
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst) -> None:
        events.append(("rename", f"{Path(src).name} -> {Path(dst).name}"))
        real_replace(src, dst)

    monkeypatch.setattr(durable.os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    root = tmp_path.resolve()
    make_engine().save_checkpoint(root, 4)
    temporary = str(root / ".tmp-global_step_4")
    assert_in_order(
        events,
        [
            ("fsync", f"{temporary}/extra/state.json"),  # every file before the manifest that vouches for it
            ("fsync", f"{temporary}/model/model.pt"),
            ("fsync", f"{temporary}/model"),
            ("fsync", f"{temporary}/.manifest.json.tmp"),
            ("rename", ".manifest.json.tmp -> manifest.json"),
            ("fsync", temporary),  # the manifest's directory entry
            ("rename", ".tmp-global_step_4 -> global_step_4"),
            ("fsync", str(root)),  # the rename, before `latest` may name the step
            ("fsync", f"{root}/.latest.tmp"),
            ("rename", ".latest.tmp -> latest"),
            ("fsync", str(root)),
        ],
    )


def assert_in_order(events: list[tuple[str, str]], expected: list[tuple[str, str]]) -> None:
    """Each expected event happens, after the one before it."""
    position = 0
    for event in expected:
        assert event in events[position:], (
            f"{event} missing after {events[position - 1 : position]}: {events}"
        )
        position = events.index(event, position) + 1


def test_nothing_loadable_names_what_exists(tmp_path):
    (tmp_path / "latest").write_text("../..")
    with pytest.raises(
        CheckpointError, match=r"holds '\.\./\.\.', which is not a step name.*Complete steps there: none"
    ):
        resolve_step_dir(tmp_path)


def test_the_next_save_deletes_what_a_save_that_died_left(tmp_path, kill_at):
    """A save killed before publication left a full-size ``.tmp-global_step_N`` that only a later save of the
    same step number removed (never, after a changed ``save_every`` or a crash on the last save); ``.trash-``
    stayed when every step was kept. The next save deletes both, keeping every step (``max_ckpt_to_keep``
    unset)."""
    engine = make_engine(keep=None)
    engine.save_checkpoint(tmp_path, 1)
    kill_at("manifest_written")
    with pytest.raises(Killed):
        engine.save_checkpoint(tmp_path, 2)
    set_fault_hook(None)
    (tmp_path / ".trash-global_step_0-0000").mkdir()
    assert names(tmp_path) == [".tmp-global_step_2", ".trash-global_step_0-0000", "global_step_1", "latest"]
    engine.save_checkpoint(tmp_path, 3)
    assert names(tmp_path) == ["global_step_1", "global_step_3", "latest"]

"""What the ranks of a save or a load share: the work on the step's files, and which step they load.

Two gloo ranks share a directory of files of uneven sizes: the gathered descriptions equal
``describe_files`` of the whole directory, each rank's share is about half the bytes, and a file altered in
one rank's share makes both ranks raise the same error. Both ranks load the step rank 0 resolved.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from drivetrain_engine_core._checkpoint.file_shares import share
from drivetrain_engine_core._checkpoint.manifest import describe_files, write_manifest
from drivetrain_engine_core.job import Manifest
from drivetrain_engine_core.testing.launcher import run_distributed

SIZES = {"model/__0_0.distcp": 900, "model/__1_0.distcp": 880, "optimizer/__0_0.distcp": 1700,
         "optimizer/__1_0.distcp": 1650, "extra/state.json": 40, "model/.metadata": 120}  # fmt: skip


def _step(root: Path) -> Path:
    for name, size in SIZES.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(bytes(i % 251 for i in range(size)))
    return root


def _describe_and_verify(rank: int, world_size: int, step: str, altered: str | None) -> dict:
    from drivetrain_engine_core._checkpoint.file_shares import describe_on_every_rank, verify_on_every_rank
    from drivetrain_engine_core.backend import CheckpointError

    files = describe_on_every_rank(Path(step))
    if altered and rank == 0:
        path = Path(step) / altered
        path.write_bytes(b"x" + path.read_bytes()[1:])  # same size, other digest
    from drivetrain_engine_core.kit import distributed

    distributed.barrier()
    manifest = Manifest(backend="fsdp", global_step=1, world_size=2, model_type="language_model",
                        model_path="m", files=files)  # fmt: skip
    try:
        verify_on_every_rank(Path(step), manifest)
    except CheckpointError as e:
        return {"files": files, "error": str(e)}
    return {"files": files, "error": None}


def test_shares_cover_every_file_once_and_balance_the_bytes():
    shares = [share(SIZES, rank, 2) for rank in range(2)]
    assert sorted(shares[0] + shares[1]) == sorted(SIZES)
    loads = [sum(SIZES[name] for name in s) for s in shares]
    assert abs(loads[0] - loads[1]) <= max(SIZES.values()) and min(loads) > 2000


@pytest.mark.parametrize("alter_in_share_of_rank_1", [False, True])
def test_every_rank_describes_and_checks_its_share(tmp_path, alter_in_share_of_rank_1):
    step = _step(tmp_path)
    expected = describe_files(step)
    altered = share(SIZES, 1, 2)[0] if alter_in_share_of_rank_1 else None
    ranks = run_distributed(_describe_and_verify, str(step), altered, world_size=2)
    assert ranks[0]["files"] == ranks[1]["files"] == expected
    if altered is None:
        assert [r["error"] for r in ranks] == [None, None]
    else:  # only rank 1 read the altered file; rank 0 raises its error too
        assert ranks[0]["error"] == ranks[1]["error"]
        assert f"{altered} does not match its SHA-256" in ranks[0]["error"]


def _agreed(rank: int, world_size: int, root: str) -> str:
    from drivetrain_engine_core._checkpoint import orchestration
    from drivetrain_engine_core.backend import CheckpointError

    if rank == 1:  # a node whose view of the filesystem lags: it would resolve another step
        orchestration.resolve_step_dir = lambda path: Path(root) / "global_step_2"  # type: ignore[assignment]
    try:
        step_dir, manifest = orchestration._agreed_step(root)
    except CheckpointError as e:
        return f"error: {e}"
    return f"{step_dir} {manifest.global_step}"


def test_every_rank_loads_the_step_rank_0_resolved(tmp_path):
    """Each rank resolved ``latest`` (and read its manifest) on its own, so ranks could load different steps;
    rank 0's resolution and manifest (or its error) now reach every rank."""
    step = tmp_path / "global_step_4"
    step.mkdir()
    manifest = Manifest(
        backend="fsdp", global_step=4, world_size=2, model_type="language_model", model_path="m"
    )
    write_manifest(step, manifest, files={})
    (tmp_path / "latest").write_text("global_step_4")
    assert run_distributed(_agreed, str(tmp_path), world_size=2) == [f"{step} 4"] * 2
    missing = run_distributed(_agreed, str(tmp_path / "nothing"), world_size=2)
    assert missing[0] == missing[1] and missing[0].startswith("error: ")


def _describe_unshared(rank: int, world_size: int, root: str) -> str:
    """Rank 1 has its own, empty disk where rank 0 wrote the step (a root that is not shared)."""
    from drivetrain_engine_core._checkpoint.file_shares import describe_on_every_rank
    from drivetrain_engine_core.backend import CheckpointError

    step = Path(root) / ("step" if rank == 0 else "other-node-disk")
    step.mkdir(exist_ok=True)
    try:
        describe_on_every_rank(step)
    except CheckpointError as e:
        return str(e)
    return "described"


def test_a_root_that_not_every_rank_sees_is_refused_on_every_rank(tmp_path):
    _step(tmp_path / "step")
    refused = run_distributed(_describe_unshared, str(tmp_path), world_size=2)
    assert refused[0] == refused[1]
    assert refused[0].startswith("rank 1 cannot find ")
    assert "must be on a filesystem every rank sees" in refused[0]


def _failing_rank(rank: int, world_size: int, root: str, where: str) -> str:
    """An error that is not a CheckpointError on one rank: an unreadable manifest on rank 0, or a permission
    error on rank 1 while it checks its share."""
    from drivetrain_engine_core._checkpoint import file_shares, orchestration
    from drivetrain_engine_core.backend import CheckpointError

    if where == "verify" and rank == 1:

        def denied(*args, **kwargs):
            raise PermissionError(13, "Permission denied", "optimizer/__1_0.distcp")

        file_shares.verify_files = denied  # type: ignore[assignment]
    try:
        step_dir, manifest = orchestration._agreed_step(root)
        file_shares.verify_on_every_rank(step_dir, manifest)
    except CheckpointError as e:
        return str(e)
    return "loaded"


@pytest.mark.parametrize("where", ["manifest", "verify"])
def test_an_unexpected_error_on_one_rank_reaches_every_rank(tmp_path, where):
    """Only CheckpointErrors were shared: an unreadable manifest (invalid UTF-8) raised on rank 0 alone, a
    permission error while checking on rank 1 alone, and the other rank waited in the next collective."""
    step = _step(tmp_path / "global_step_1")
    write_manifest(step, Manifest(backend="fsdp", global_step=1, world_size=2, model_type="language_model",
                                  model_path="m"))  # fmt: skip
    if where == "manifest":
        (step / "manifest.json").write_bytes(b"\xff\xfe{")
    ranks = run_distributed(_failing_rank, str(step), where, world_size=2)
    assert ranks[0] == ranks[1] != "loaded"
    expected = "rank 0: UnicodeDecodeError" if where == "manifest" else "rank 1: PermissionError"
    assert ranks[0].startswith(expected)

"""Files only rank 0 writes: a failed write raises on every rank. Rank 0 raised alone after the final model's
gathering while the others waited at a barrier until the process-group timeout (a reward head with a bias did
the same through ``export_reward_model``)."""

from __future__ import annotations

from pathlib import Path

from drivetrain_engine_core.testing.launcher import run_distributed


def _failing_write(rank: int, world_size: int, target: str) -> str:
    from drivetrain_engine_core.backend import CheckpointError
    from drivetrain_roles.jobs.rank_zero_write import rank_zero_write

    try:
        with rank_zero_write("the final model", Path(target)):
            if rank == 0:
                raise OSError(28, "No space left on device")
    except CheckpointError as e:
        return str(e)
    return "written"


def test_a_write_that_fails_on_rank_zero_raises_on_every_rank(tmp_path) -> None:
    target = str(tmp_path / "final_model")
    messages = run_distributed(_failing_write, target, world_size=2, timeout_s=60)
    for message in messages:
        assert message.startswith(
            f"rank 0 (of failing ranks 0): could not write the final model to {target}: [Errno 28] No space left"
        )
        assert "the run's last checkpoint holds the weights" in message

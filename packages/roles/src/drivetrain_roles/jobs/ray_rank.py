"""One rank of a job placed by Ray: the process behind each Ray actor of ``trainer.placement=ray``.

The actor joins the job's world through the environment torchrun would give it (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ...) and runs the command's own rank (:func:`~.rank_job.run_rank`), so the run folder, the
checkpoints and every number are the torchrun path's. A user error comes back as its one line, a crash as a
one-line summary with the traceback in ``<run>/logs/rank<R>.log``. The class is plain Python; the launcher wraps
it with ``ray.remote`` (:mod:`.ray_launch`), so this module imports without Ray.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import traceback
from pathlib import Path
from typing import Any

from drivetrain_engine_core.backend import DrivetrainError

from .launch import LOG_DIR
from .rank_failures import ERROR_DIR_ENV
from .run_options import RunOptions


class RankFailed(DrivetrainError):
    """A rank placed by Ray stopped on a user error; the message is the one line to print."""


class RankCrashed(RankFailed):
    """A rank placed by Ray crashed; the message names the rank, the exception and the log of its traceback."""


class RankInterrupted(RankFailed):
    """A rank placed by Ray stopped on Ctrl-C after a step, with its checkpoint; the message names both."""


class RayRank:
    """One rank of the job, in one Ray actor, with its inbox folder on its node (:mod:`.ray_ctrl_c`)."""

    def __init__(self) -> None:
        self.inbox = tempfile.mkdtemp(prefix="drivetrain-ray-rank-")

    def where(self) -> tuple[str, str, str]:
        """``(node id, node IP, inbox folder)`` of this rank."""
        return (*self.node(), self.inbox)

    def node(self) -> tuple[str, str]:
        """``(node id, node IP)`` of the Ray node this rank runs on."""
        import ray

        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

    def free_port(self) -> int:
        """A TCP port free on this node now (rank 0's: the world's rendezvous)."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("", 0))
            return int(sock.getsockname()[1])

    def run(
        self, command: str, config: Any, job: type, run: RunOptions, environment: dict[str, str]
    ) -> str | None:
        """Run this rank of ``drivetrain <command>`` in ``run.output_dir`` with ``environment`` set; returns rank
        0's closing lines.

        Raises:
            RankFailed: the rank's user error (its one line).
            RankCrashed: a crash (the exception, where it was raised and the log holding its traceback).
            RankInterrupted: Ctrl-C, sent on by the driver, stopped the run after a step and saved it.
        """
        from drivetrain_engine_core.backend import ConfigError

        from .interrupt import RunInterrupted
        from .rank_job import run_job

        os.environ.update(environment, **{ERROR_DIR_ENV: self.inbox})
        try:
            return run_job(config, job, str(run.output_dir), run)
        except RunInterrupted as e:
            raise RankInterrupted(f"drivetrain {command}: {e}") from None
        except (DrivetrainError, ConfigError) as e:
            raise RankFailed(f"drivetrain {command}: error: {' '.join(str(e).split())}") from None
        except Exception as e:
            raise RankCrashed(_crash_line(command, e, Path(str(run.output_dir)))) from None
        finally:
            shutil.rmtree(self.inbox, ignore_errors=True)


def _crash_line(command: str, error: Exception, run_dir: Path) -> str:
    """Write ``error``'s traceback to ``<run>/logs/rank<R>.log``; the line naming the rank, the error and the log."""
    rank = os.environ.get("RANK", "0")
    log = run_dir / LOG_DIR / f"rank{rank}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("".join(traceback.format_exception(error)))
    where = traceback.extract_tb(error.__traceback__)[-1]
    return (
        f"drivetrain {command}: rank {rank} crashed: {type(error).__name__}: {' '.join(str(error).split())[:300]} "
        f"(at {Path(where.filename).name}:{where.lineno}); traceback in {log}"
    )


__all__ = ["RankCrashed", "RankFailed", "RankInterrupted", "RayRank"]

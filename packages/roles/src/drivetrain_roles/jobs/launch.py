"""Starting the ranks of a job (``sft``, ``dpo``, ``rm``, ``grpo``): in this process, or ``N`` processes through ``torch.distributed.run``.

``drivetrain <command> --nproc N`` launches ``N`` ranks of ``python -m drivetrain_roles.jobs.rank_entry <command> ...``
with the same arguments through torch's elastic launcher (what ``torchrun --standalone`` runs), in this process, so a run
needs no separate launcher; the rank finds the command by name among the registered ones (:mod:`.rank_entry`), so
a third party's command launches as roles' own do. Under an outer ``torchrun`` (``WORLD_SIZE`` set) the command
runs as one rank.

A user error or a crash inside the ranks is reported by the launcher in one line (:mod:`.rank_failures`),
which exits 1: not ``N`` copies followed by torchrun's traceback; a crash's full traceback is in
``<run>/logs/rank<R>.log``. Ctrl-C prints one line and exits 130: the first one, while the ranks train, stops
them after the current step with a checkpoint (:mod:`.interrupt`); otherwise, and on a second one, every rank
is stopped at once.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import sys
import tempfile
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NoReturn

import click
from drivetrain_engine_core.backend import EngineConfig
from drivetrain_engine_core.job import INTERRUPTED

from ..runtime.descendants import owning_descendants
from .interrupt import forwarding_ctrl_c, interrupt_report
from .nodes import NODE_RANK_ENV, TIMEOUT_ENV, Nodes
from .rank_failures import ERROR_DIR_ENV, LOG_DIR_ENV, failure_report, report_rank_crash, report_rank_error

OUTPUTS_ROOT = Path("outputs")
CHECKPOINT_DIR = "checkpoints"
CONFIG_FILE = "config.yaml"
"""The run's resolved config; a ``--resume`` without ``--config`` starts from it."""
SUMMARY_FILE = "summary.json"
"""Written last by every job: a run folder with it holds a finished run."""
LOG_DIR = "logs"
"""In the run folder: a crashed rank's full traceback (``rank<R>.log``)."""
RANK_ENTRY = "drivetrain_roles.jobs.rank_entry"
"""The module every spawned rank runs (``python -m``), followed by the command's name and its arguments."""
_CPP_LOG_LEVEL = "TORCH_CPP_LOG_LEVEL"
_quieted_cpp_logs = False
_TORCH_HANDLED_SIGNALS = "SIGTERM,SIGHUP,SIGQUIT"
"""The signals torch's launcher turns into its ``SignalException``: its default list less SIGINT."""


def under_launcher() -> bool:
    """Whether this process is one rank of a torchrun-style launch."""
    return "WORLD_SIZE" in os.environ


def new_output_dir(command: str, root: Path = OUTPUTS_ROOT) -> Path:
    """``outputs/<command>-<UTC timestamp>``, claimed by creating it: a launch in the same second gets
    ``-2``, ``-3``, ... (two jobs of a sweep started together shared one folder: each other's config,
    metrics and checkpoints). A rank other than 0 of an outer launcher only names it (rank 0's claim is the
    run's: :func:`agreed_output_dir`)."""
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S")
    base = root / f"{command}-{stamp}"
    if os.environ.get("RANK", "0") != "0":
        return base
    root.mkdir(parents=True, exist_ok=True)
    candidate, number = base, 1
    while True:
        try:
            candidate.mkdir()
            return candidate
        except FileExistsError:
            number += 1
            candidate = base.with_name(f"{base.name}-{number}")


def latest_output_dir(command: str, root: Path = OUTPUTS_ROOT) -> Path | None:
    """The newest ``outputs/<command>-*`` run that holds a checkpoint (what ``--resume`` continues by default)."""
    from drivetrain_engine_core.job import complete_steps

    runs = sorted(p for p in root.glob(f"{command}-*") if complete_steps(p / CHECKPOINT_DIR))
    return runs[-1] if runs else None


def check_run_dir(run_dir: Path, *, resume: bool, overwrite: bool) -> None:
    """A resumed run needs a checkpoint in ``run_dir``; a new run needs none there unless told to overwrite.

    Checked before any rank starts, so that a new run never prunes or overwrites another run's steps and
    metrics, and ``--resume`` never silently starts from step 0.

    Raises:
        CheckpointError: the run directory does not fit the request; the message names the flag to change.
    """
    from drivetrain_engine_core.backend import CheckpointError
    from drivetrain_engine_core.job import complete_steps

    root = run_dir / CHECKPOINT_DIR
    # NOTE: loadable steps only: a save cut short after its manifest leaves a complete temporary directory,
    # which no resume can load (it is published by renaming) and which the next save deletes.
    complete = [path.name for _, path in complete_steps(root)]
    if resume and not complete:
        raise CheckpointError(
            f"--resume: {root} holds no complete checkpoint, so there is nothing to continue. Drop --resume to "
            f"start a new run in {run_dir}, or pass the --output-dir of the run to continue."
        )
    if not resume and not overwrite and complete:
        raise CheckpointError(
            f"{run_dir} already holds checkpoints of a run ({', '.join(complete)}); a new run there would prune "
            "and overwrite them. Continue that run with --resume, choose another --output-dir, or pass "
            "--overwrite to delete them and start over."
        )


def resolve_output_dir(output_dir: str | None, resume: bool, command: str) -> Path:
    """The run directory: as given; else for ``--resume`` the newest resumable run; else a new one.

    Raises:
        FileNotFoundError: ``--resume`` without ``--output-dir`` and no resumable run under ``outputs/``.
    """
    if output_dir is not None:
        return Path(output_dir)
    if resume:
        latest = latest_output_dir(command)
        if latest is None:
            raise FileNotFoundError(
                f"--resume found no run with a checkpoint under {OUTPUTS_ROOT.resolve()}/{command}-*; pass "
                "--output-dir DIR of the run to continue."
            )
        return latest
    return new_output_dir(command)


def spawn_ranks(
    nproc: int, arguments: Sequence[str], command: str, run_dir: Path, nodes: Nodes | None = None
) -> int:
    """Run ``nproc`` ranks of ``drivetrain <command> <arguments>`` in ``run_dir`` on this node of ``nodes``
    (default: this node alone); returns the exit code for the command.

    NOTE: Ctrl-C stays Python's ``KeyboardInterrupt`` here: torch's launcher, left its default, turns SIGINT
    into its ``SignalException``, an ``Exception`` that torch's own rendezvous and store code catches and
    records, and forwards SIGINT to ranks still importing (a ``site`` traceback per rank). A
    ``KeyboardInterrupt`` passes every ``except Exception``; the agent's ``finally`` stops the ranks with
    SIGTERM, which ends them silently.

    Returns:
        0 on success; 1 after printing one line for the failure (:func:`.rank_failures.failure_report`, or a
        rendezvous that did not complete: :meth:`.nodes.Nodes.rendezvous_failed`); 130 after Ctrl-C (the first
        one, while the ranks train, is sent on to them: :func:`.interrupt.forwarding_ctrl_c`).
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.launcher.api import elastic_launch

    nodes = nodes or Nodes()
    unreachable = nodes.unreachable(command)
    if unreachable is not None:
        click.echo(unreachable, err=True)
        return 1
    # The agent logs each failed rank; the one line below replaces those logs for user errors.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    config = nodes.launch_config(command, nproc, uuid.uuid4().hex, _TORCH_HANDLED_SIGNALS)
    with (
        tempfile.TemporaryDirectory(prefix=f"drivetrain-{command}-errors-") as errors,
        _rank_environment(errors, run_dir / LOG_DIR, nodes),
        owning_descendants(),  # no helper a rank started (megatron's checkpoint writer) outlives the command
    ):
        try:
            with forwarding_ctrl_c(Path(errors), command):
                elastic_launch(config, sys.executable)("-m", RANK_ENTRY, command, *arguments)
        except ChildFailedError as e:
            click.echo(failure_report(Path(errors), command, e.failures, nodes.describe()), err=True)
            return 1
        except RendezvousError as e:
            click.echo(nodes.rendezvous_failed(command, e), err=True)
            return 1
        except (KeyboardInterrupt, SignalException):
            click.echo(f"drivetrain {command}: interrupted; every rank was stopped.", err=True)
            return INTERRUPTED
        interrupted = interrupt_report(Path(errors))  # the ranks stopped after a step and saved it
        if interrupted is not None:
            click.echo(interrupted, err=True)
            return INTERRUPTED
    return 0


@contextlib.contextmanager
def _rank_environment(error_dir: str, log_dir: Path, nodes: Nodes) -> Iterator[None]:
    """Environment of the spawned ranks, restored afterwards: where to report failures, how long to wait for
    the run folder's markers and which node to name (:mod:`.shared_folder`), one thread per rank."""
    # Two ranks on a small CPU machine: one intra-op thread each avoids oversubscribing the cores.
    values: dict[str, str | None] = {
        ERROR_DIR_ENV: error_dir,
        LOG_DIR_ENV: str(log_dir),
        TIMEOUT_ENV: str(nodes.rdzv_timeout_s),
        NODE_RANK_ENV: str(nodes.node_rank),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        **({_CPP_LOG_LEVEL: None} if _quieted_cpp_logs else {}),  # the ranks log as the user asked
    }
    saved = {key: os.environ.get(key) for key in values}
    _set_environment(values)
    try:
        yield
    finally:
        _set_environment(saved)


def _set_environment(values: dict[str, str | None]) -> None:
    """Set each variable of ``values``, removing those whose value is None."""
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def quiet_torch_cpp_logs() -> None:
    """In a process about to launch ranks, before it imports torch: torch's C++ logs only fatal messages here.

    NOTE: when a peer node's launcher ends first (its ranks failed, it gave up on the rendezvous), c10d's store
    client in this launcher logs a warning with a page of C++ stack per attempt, around the one line drivetrain
    prints. The level is read once, when torch loads; the spawned ranks get the user's setting back.
    """
    global _quieted_cpp_logs
    if "torch" not in sys.modules and _CPP_LOG_LEVEL not in os.environ:
        os.environ[_CPP_LOG_LEVEL] = "FATAL"
        _quieted_cpp_logs = True


def rank_main(command: click.Command, name: str, arguments: Sequence[str]) -> NoReturn:
    """Run one spawned rank of ``drivetrain <name> <arguments>``: a user error or a crash is one line handed to
    the launcher, not a traceback; Ctrl-C ends the rank quietly. The rank ends without the interpreter's
    teardown, where torch's gloo threads can abort a rank whose work is done (core's ``process_exit``).

    NOTE: the rank dies with its launcher: torch's launcher starts each rank in its own session, so a launcher
    killed outright (kill -9, the OOM killer) left its ranks training, saving and pruning in the run folder,
    beside the ``--resume`` the user started next.
    """
    from drivetrain_engine_core.job import die_with_parent, run_then_exit

    die_with_parent()
    run_then_exit(lambda: _run_rank(command, name, arguments))


def _run_rank(command: click.Command, name: str, arguments: Sequence[str]) -> None:
    from drivetrain_engine_core.backend import ConfigError, DrivetrainError

    try:
        command.main(list(arguments), prog_name=f"drivetrain {name}", standalone_mode=False)
    except (DrivetrainError, ConfigError, click.ClickException) as e:
        report_rank_error(f"drivetrain {name}: error: {' '.join(str(e).split())}")
        sys.exit(1)
    except (KeyboardInterrupt, click.exceptions.Abort):
        sys.exit(INTERRUPTED)
    except Exception as e:
        if not report_rank_crash(name, e):  # not spawned by drivetrain: the traceback prints as usual
            raise
        sys.exit(1)


def agreed_output_dir(output_dir: str, engine: EngineConfig) -> str:
    """Under an outer torchrun without ``--output-dir`` each rank made its own timestamp: use rank 0's."""
    from drivetrain_engine_core.kit import distributed

    distributed.init_distributed(engine.device, engine.dist_timeout_s)
    return str(distributed.broadcast_object(output_dir))

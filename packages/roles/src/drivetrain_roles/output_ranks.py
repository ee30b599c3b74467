"""Refusing, up front and on every rank, a parallel layout in which an algorithm cannot read its outputs.

GRPO (old log-probs, rewards per rank) and DPO with a reference (every pair's reference log-probs on every
rank) read per-token outputs on every rank. Under tensor or pipeline parallelism (Megatron) or Ulysses
sequence parallelism (FSDP) only one rank of each model-parallel group holds them: the run used to fail on
the first step, after collectives on inputs the group's ranks did not share.
"""

from __future__ import annotations

from drivetrain_engine_core.backend import ConfigError, Engine
from drivetrain_engine_core.kit import distributed


def require_outputs_on_every_rank(engine: Engine, needed_by: str) -> None:
    """Raise the same :class:`ConfigError` on every rank unless every rank of ``engine`` is an output rank.

    Args:
        engine: an initialised engine (collective: every rank calls this).
        needed_by: what reads the outputs, for the message (``"drivetrain grpo"``).
    """
    without = int(distributed.all_reduce_sum(0 if engine.is_output_rank else 1))
    if without:
        raise ConfigError(
            f"{needed_by} reads per-token outputs on every rank, but {without} of {distributed.world_size()} "
            "ranks hold none (tensor or pipeline parallelism on megatron, engine.ulysses_sequence_parallel_size "
            "> 1 on fsdp). Run it with data parallelism only: set those sizes to 1."
        )

"""GRPO and DPO with a reference need outputs on every rank: a model-parallel layout is refused on all ranks.

Two gloo ranks stand in for a tensor-parallel pair (rank 0 the output rank, rank 1 not, as Megatron's TP2
or FSDP's Ulysses 2 lay them out): before, the run failed on its first step after collectives on inputs the
pair did not share; now both ranks raise the same error before any step.
"""

from __future__ import annotations

from types import SimpleNamespace

from drivetrain_engine_core.testing.launcher import run_distributed


def _check(rank: int, world_size: int, output_ranks: tuple[bool, ...]) -> str:
    from drivetrain_engine_core.backend import ConfigError
    from drivetrain_roles.output_ranks import require_outputs_on_every_rank

    engine = SimpleNamespace(is_output_rank=output_ranks[rank])
    try:
        require_outputs_on_every_rank(engine, "drivetrain grpo")  # type: ignore[arg-type]
    except ConfigError as e:
        return str(e)
    return "accepted"


def test_every_rank_refuses_a_layout_where_one_rank_holds_no_outputs():
    refused = run_distributed(_check, (True, False), world_size=2)
    assert refused[0] == refused[1]
    assert refused[0].startswith(
        "drivetrain grpo reads per-token outputs on every rank, but 1 of 2 ranks hold none"
    )
    assert "set those sizes to 1" in refused[0]
    assert run_distributed(_check, (True, True), world_size=2) == ["accepted", "accepted"]

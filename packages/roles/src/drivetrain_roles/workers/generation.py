"""Generation over several rollout workers: prompts split by data-parallel rank, answers merged back in order.

Shared by the colocated group (a rollout beside the engines on every rank) and the rollout group of the
disaggregated placement (rollouts on their own workers).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from drivetrain_engine_core.backend import BatchError
from drivetrain_engine_core.rollout import RolloutOutput, SamplingConfig

from .actors import WorkerGroupError
from .dispatch import WorkerTopology


def prompt_shards(
    prompts: Sequence[Sequence[int]], sampling: SamplingConfig, topology: Sequence[WorkerTopology]
) -> list[tuple[list[list[int]], SamplingConfig]]:
    """Each worker's prompts and sampling: contiguous equal slices by data-parallel rank (whole groups stay on
    one rank), seed ``sampling.seed + dp_rank``.

    Raises:
        BatchError: the prompts do not split evenly over the data-parallel ranks.
    """
    dp_size = topology[0].dp_size
    if not prompts or len(prompts) % dp_size:
        raise BatchError(
            f"generate: {len(prompts)} prompts cannot be split evenly over dp_size={dp_size}; pass a "
            "non-zero multiple of it."
        )
    per_rank = len(prompts) // dp_size
    return [
        (
            [list(p) for p in prompts[w.dp_rank * per_rank : (w.dp_rank + 1) * per_rank]],
            dataclasses.replace(sampling, seed=sampling.seed + w.dp_rank),
        )
        for w in topology
    ]


def merged_output(
    outputs: Sequence[RolloutOutput], topology: Sequence[WorkerTopology], n: int
) -> RolloutOutput:
    """The workers' answers as one prompt-major output in the prompts' order.

    Raises:
        WorkerGroupError: the workers served different weight versions.
    """
    by_dp_rank = {w.dp_rank: o for w, o in zip(topology, outputs, strict=True) if w.is_output_rank}
    versions = {output.version for output in outputs}
    if len(versions) != 1:
        raise WorkerGroupError(
            f"rollout.generate: the workers served different weight versions {sorted(map(str, versions))}; "
            "hand the weights off to every rollout before generating."
        )
    ordered = [by_dp_rank[d] for d in range(topology[0].dp_size)]
    recorded = all(output.routed_experts is not None for output in ordered)  # router replay
    return RolloutOutput(
        responses=[r for output in ordered for r in output.responses],
        log_probs=[lp for output in ordered for lp in output.log_probs],
        version=versions.pop(),
        n=n,
        routed_experts=[r for output in ordered for r in output.routed_experts or ()] if recorded else None,
    )

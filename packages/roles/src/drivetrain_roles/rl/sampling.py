"""What the rollout is asked for and given: each step's sampling (its seed a function of the step and rank) and
the weight hand-off from the actor."""

from __future__ import annotations

import dataclasses

from drivetrain_engine_core.rollout import LoraMode, Rollout, SamplingConfig

from ..actor import Actor
from .job_config import RolloutJobConfig

SEED_STRIDE = 1_000_003
"""Sampling seeds are ``seed + SEED_STRIDE * step + rank``: distinct per step and rank, repeatable on resume."""


def sampling_config(config: RolloutJobConfig, *, seed: int) -> SamplingConfig:
    """The step's sampling: ``rollout.n`` responses per prompt at the rollout's temperature, truncated by its
    ``top_k``/``top_p``/``min_p``, recording routed experts under ``rollout.router_replay=R3``."""
    sampling = config.rollout.sampling(seed=seed)
    return dataclasses.replace(sampling, record_routed_experts=config.rollout.records_routes)


def hand_off(
    actor: Actor, rollout: Rollout, version: int, bucket_mb: float, lora: LoraMode = "merged"
) -> dict[str, float]:
    """Stream the actor's weights (``lora``: merged, or its adapters alone) to the rollout as ``version``
    (collective over the actor's ranks): a delta on the version the rollout serves intact, else in full. Returns
    the sync's metrics (``rollout/sync_bytes``, ...)."""
    buckets = actor.engine.weight_buckets(
        version=version, bucket_bytes=int(bucket_mb * 2**20), base_version=rollout.delta_base, lora=lora
    )
    rollout.update_weights(buckets)
    return rollout.last_sync.as_metrics() if rollout.last_sync is not None else {}

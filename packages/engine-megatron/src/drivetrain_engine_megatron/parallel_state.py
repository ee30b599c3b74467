"""Megatron's model-parallel process groups, created once per process from the engine config."""

from __future__ import annotations

import math

import torch.distributed as dist
from megatron.core import parallel_state as mpu

from .config import MegatronEngineConfig


def initialize_model_parallel(config: MegatronEngineConfig) -> None:
    """Create the tensor/pipeline/context/data-parallel groups (idempotent for an identical layout).

    Raises:
        ConfigError: the world size is not a multiple of the model-parallel size.
        ValueError: megatron's groups already exist with another layout.
    """
    config.check_world(dist.get_world_size())
    if mpu.model_parallel_is_initialized():
        _check_existing_layout(config)
        return
    mpu.initialize_model_parallel(
        tensor_model_parallel_size=config.tensor_model_parallel_size,
        pipeline_model_parallel_size=config.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=config.virtual_pipeline_model_parallel_size,
        context_parallel_size=config.context_parallel_size,
        expert_model_parallel_size=config.expert_model_parallel_size,
        distributed_timeout_minutes=max(1, math.ceil(config.dist_timeout_s / 60)),
    )


def _check_existing_layout(config: MegatronEngineConfig) -> None:
    existing = (
        mpu.get_tensor_model_parallel_world_size(),
        mpu.get_pipeline_model_parallel_world_size(),
        mpu.get_context_parallel_world_size(),
        mpu.get_expert_model_parallel_world_size(),
    )
    wanted = (
        config.tensor_model_parallel_size,
        config.pipeline_model_parallel_size,
        config.context_parallel_size,
        config.expert_model_parallel_size,
    )
    if existing != wanted:
        raise ValueError(
            f"megatron's process groups already exist with (tp, pp, cp, ep) = {existing}, this engine asks for {wanted}; "
            "one process holds one megatron layout: build engines with the same parallel sizes."
        )


def data_parallel_group() -> dist.ProcessGroup:
    """Ranks that hold the same model shard and see different data (context parallel excluded)."""
    return mpu.get_data_parallel_group()


def data_parallel_rank() -> int:
    return mpu.get_data_parallel_rank()


def data_parallel_size() -> int:
    return mpu.get_data_parallel_world_size()


def is_output_rank() -> bool:
    """Last pipeline stage, tensor rank 0: the rank that holds a data-parallel shard's outputs and metrics."""
    return mpu.is_pipeline_last_stage(ignore_virtual=True) and mpu.get_tensor_model_parallel_rank() == 0

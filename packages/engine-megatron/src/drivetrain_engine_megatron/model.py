"""Build the model chunks of this rank: bridge, ``GPTModel``, Hugging Face weights, value head, DDP.

A language model's output layer is checked here (:func:`.head.check_output_layer`): the engine computes
log-probs from the hidden states and its weight, so a model it cannot take fails before any weight is read.

The ``TransformerConfig`` values pinned here are the ones drivetrain's numbers depend on:
``calculate_per_token_loss`` makes megatron neither divide the loss by the micro-batch count nor average
gradients over data-parallel ranks (drivetrain's losses are already normalised by the global token count),
and the fusions are off because their kernels need CUDA (and the local layer spec does not use them).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from drivetrain_engine_core.backend import ModelConfig
from drivetrain_engine_core.kit import disable_dropout_in_config, read_checkpoint_index
from mbridge.core.bridge import Bridge
from megatron.core import parallel_state as mpu
from megatron.core import tensor_parallel
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from transformers import AutoConfig

from .bridge import build_model_chunks, load_hf_weights, make_bridge
from .config import MegatronEngineConfig
from .head import check_output_layer
from .moe import moe_overrides
from .padding_row import freeze_padding_lookups
from .value_head import attach_value_head, fresh_head_parameters, head_parameters_hidden

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class BuiltModel:
    """This rank's model chunks (DDP-wrapped when trainable) and the bridge that maps their weights.

    Attributes:
        bridge: the mbridge bridge (weight names, export).
        chunks: one module per virtual-pipeline stage; DDP-wrapped when the engine trains.
        vocab_size: the tokenizer's vocabulary (logits beyond it are padding).
        transformer_config: the megatron ``TransformerConfig`` the chunks were built with.
    """

    bridge: Bridge
    chunks: list[torch.nn.Module]
    vocab_size: int
    transformer_config: Any

    @property
    def unwrapped(self) -> list[torch.nn.Module]:
        """The ``GPTModel`` chunks without their DDP wrappers (what mbridge reads and writes)."""
        return [
            chunk.module if isinstance(chunk, DistributedDataParallel) else chunk for chunk in self.chunks
        ]


def transformer_overrides(config: MegatronEngineConfig) -> dict[str, Any]:
    """``TransformerConfig`` values drivetrain sets on top of what mbridge derives from the HF config."""
    return {
        "sequence_parallel": config.sequence_parallel,
        # Packed rows differ in length per micro-batch: pipeline stages exchange shapes before tensors.
        "variable_seq_lengths": True,
        "calculate_per_token_loss": True,
        "masked_softmax_fusion": False,
        "bias_activation_fusion": False,
        "bias_dropout_fusion": False,
        "apply_rope_fusion": False,
        "gradient_accumulation_fusion": False,
        "persist_layer_norm": False,
        "deallocate_pipeline_outputs": False,
    }


def vocab_divisor(vocab_size: int, config: MegatronEngineConfig) -> int | None:
    """Pad the vocabulary to a multiple of this (``None``: no padding), as vocab-parallel layers need."""
    divisor = (config.make_vocab_size_divisible_by or 1) * config.tensor_model_parallel_size
    return None if vocab_size % divisor == 0 else divisor


def build_model(
    model_config: ModelConfig, engine_config: MegatronEngineConfig, trainable: bool
) -> BuiltModel:
    """Build, load and (when ``trainable``) wrap this rank's chunks of the model at ``model_config.path``."""
    hf_config = AutoConfig.from_pretrained(
        model_config.path, trust_remote_code=model_config.trust_remote_code
    )
    if model_config.disable_dropout:
        # mbridge derives the layers' hidden and attention dropout from these fields.
        disable_dropout_in_config(hf_config)
    value_model = model_config.model_type == "value_model"
    dtype = _DTYPES[engine_config.param_dtype]
    overrides = {**transformer_overrides(engine_config), **moe_overrides(hf_config, engine_config)}
    if model_config.gradient_checkpointing:
        overrides.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    bridge = make_bridge(
        hf_config,
        dtype,
        overrides,
        value_model=value_model,
        make_vocab_size_divisible_by=vocab_divisor(hf_config.vocab_size, engine_config),
    )
    chunks = build_model_chunks(bridge, engine_config.virtual_pipeline_model_parallel_size)
    last_stage = mpu.is_pipeline_last_stage(ignore_virtual=True)
    if value_model and last_stage:
        group = mpu.get_tensor_model_parallel_group() if engine_config.sequence_parallel else None
        attach_value_head(chunks[-1], hf_config, dtype, engine_config.seed, sequence_parallel_group=group)
    elif last_stage:
        check_output_layer(chunks[-1], hf_config.model_type)
    for chunk in chunks:
        # NOTE: every parameter in the compute dtype, as megatron's Float16Module (``module.bfloat16()``) makes
        # it. The local spec's torch norms ignore ``params_dtype`` and stay float32 otherwise, and megatron's
        # mixed-precision optimizers pair optimizer state with parameters assuming one dtype: a bf16 model with
        # float32 norms cannot save its optimizer (the state of a norm is paired with a matrix).
        chunk.to(device=engine_config.device, dtype=dtype)
        freeze_padding_lookups(chunk, getattr(hf_config, "pad_token_id", None))
        for param in chunk.parameters():
            tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
    if not model_config.from_config_only:
        fresh = (
            fresh_head_parameters(chunks[-1], read_checkpoint_index(Path(model_config.path)).shapes)
            if value_model and last_stage
            else []
        )
        with head_parameters_hidden(chunks[-1], fresh):
            load_hf_weights(bridge, chunks, model_config.path)
    if trainable:
        chunks = [_wrap_ddp(chunk, index, bridge.config, engine_config) for index, chunk in enumerate(chunks)]
    return BuiltModel(
        bridge=bridge, chunks=chunks, vocab_size=hf_config.vocab_size, transformer_config=bridge.config
    )


def _wrap_ddp(
    chunk: torch.nn.Module, index: int, transformer_config: Any, engine_config: MegatronEngineConfig
) -> DistributedDataParallel:
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=engine_config.use_distributed_optimizer,
    )
    # Bucketing only for the first chunk: later virtual-pipeline chunks reduce while others compute.
    return DistributedDataParallel(
        config=transformer_config, ddp_config=ddp_config, module=chunk, disable_bucketing=index > 0
    )

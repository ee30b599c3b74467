"""``model/`` and ``optimizer/`` of a step with megatron-core dist_checkpointing (ARCHITECTURE §5).

Both are written in the ``torch_dist`` format (torch.distributed.checkpoint underneath), keyed by the global
``GPTModel`` parameter names, so a step can be read back at another data-parallel size and merged to Hugging
Face without megatron process groups. The optimizer state uses ``dp_reshardable`` sharding, the one that
works for the DistributedOptimizer over gloo. The core writes the scheduler, RNG and manifest.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from drivetrain_engine_core.kit import MODEL_DIR, OPTIMIZER_DIR, check_saved_shapes, read_manifest
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.optimizer import MegatronOptimizer
from megatron.core.transformer.module import MegatronModule

from .config import MegatronEngineConfig
from .dist_opt_layout import write_layout
from .dist_opt_padding import clip_padding_past_bucket_end
from .model import BuiltModel

FORMAT = "megatron-dist-checkpointing/torch_dist"
_OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


def _model_sharded_state_dict(model: BuiltModel) -> dict[str, Any]:
    """Every chunk's sharded state dict under ``model<i>`` (keys inside are global, chunk-independent)."""
    return {f"model{i}": _chunk_sharded_state_dict(chunk) for i, chunk in enumerate(model.unwrapped)}


def _global_shapes(sharded_state: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The checkpoint key and global shape of every tensor a sharded state dict loads (those megatron lets
    differ in shape left out)."""
    return {
        value.key: tuple(value.global_shape)
        for value in nested_values(sharded_state)
        if isinstance(value, ShardedTensor) and not value.allow_shape_mismatch
    }


def _chunk_sharded_state_dict(chunk: torch.nn.Module) -> dict[str, Any]:
    """One unwrapped chunk's sharded state dict; only megatron modules know how to shard themselves."""
    if not isinstance(chunk, MegatronModule):
        raise TypeError(
            f"dist_checkpointing needs megatron modules, got a {type(chunk).__name__} chunk; build the model "
            "with build_model() so every chunk is a GPTModel."
        )
    return chunk.sharded_state_dict()


def save_model_and_optimizer(step_dir: Path, model: BuiltModel, optimizer: MegatronOptimizer | None) -> None:
    """Write ``model/`` (and ``optimizer/``) under ``step_dir`` (collective over all ranks)."""
    _save(_model_sharded_state_dict(model), step_dir / MODEL_DIR)
    if optimizer is not None:
        # NOTE: an optimizer that has not stepped yet (a step-0 save, or only skipped steps: fp16 overflows
        # while the loss scale settles, a NaN loss) has no torch AdamW state, and megatron's distributed
        # optimizer without Apex/TE then fails to read its step count. Zero state at step 0 is exactly what
        # torch AdamW creates on its first step, so this changes no update.
        allocate_adam_state(optimizer)
        # A fresh model state dict: saving may have consumed the first one's factories.
        optimizer_state = optimizer.sharded_state_dict(
            _model_sharded_state_dict(model), metadata=_OPTIMIZER_METADATA
        )
        _save(clip_padding_past_bucket_end(optimizer_state), step_dir / OPTIMIZER_DIR)
        # A distributed optimizer's flat buckets say not which range is which parameter: record it, so the
        # moments can move to another backend or layout (:mod:`.dist_opt_layout`).
        write_layout(step_dir, _model_sharded_state_dict(model), optimizer)


OPTIMIZER_LAYOUT = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size",
    "expert_model_parallel_size",
    "use_distributed_optimizer",
)
"""The settings an optimizer state is saved for: megatron's ``dp_reshardable`` format reshards across
data-parallel ranks only; a step saved with other values loads through its Hugging Face-named state
(:mod:`.hf_state`). Expert parallelism changes which optimizer and data-parallel group hold an expert's state
(an EP2 step loaded straight into EP1 failed inside torch's distributed checkpoint). A step whose manifest
lacks a key (saved before it was recorded) counts as saved with the same value."""


def optimizer_layout_changed(step_dir: Path, config: MegatronEngineConfig) -> bool:
    """Whether ``step_dir``'s optimizer state was saved with another :data:`OPTIMIZER_LAYOUT` (dist_checkpointing
    then failed with a ``KeyError`` over megatron's state-dict keys)."""
    saved = read_manifest(step_dir).backend_info
    return any(key in saved and saved[key] != getattr(config, key) for key in OPTIMIZER_LAYOUT)


def load_model_and_optimizer(
    step_dir: Path, model: BuiltModel, optimizer: MegatronOptimizer | None, *, load_optimizer: bool
) -> None:
    """Read what :func:`save_model_and_optimizer` wrote into the live model (and, with ``load_optimizer``,
    the optimizer).

    Without ``load_optimizer`` the optimizer's float32 main weights are refreshed from the loaded model
    (megatron's ``reload_model_params``, as Megatron-LM does under ``--no-load-optim``): in bf16/fp16 they are
    copies taken when the optimizer was built, so the next step updated the starting weights and wrote them
    back over the loaded ones.
    """
    with torch.no_grad():
        model_state = _model_sharded_state_dict(model)
        check_saved_shapes(step_dir, step_dir / MODEL_DIR, _global_shapes(model_state))
        loaded = dist_checkpointing.load(model_state, str(step_dir / MODEL_DIR))
        for i, chunk in enumerate(model.unwrapped):
            chunk.load_state_dict(loaded[f"model{i}"], strict=True)
        if optimizer is not None and not load_optimizer:
            optimizer.reload_model_params()
        elif optimizer is not None:
            allocate_adam_state(optimizer)
            model_state = _model_sharded_state_dict(model)
            optimizer_state = clip_padding_past_bucket_end(
                optimizer.sharded_state_dict(model_state, is_loading=True, metadata=_OPTIMIZER_METADATA)
            )
            loaded_optimizer = dist_checkpointing.load(optimizer_state, str(step_dir / OPTIMIZER_DIR))
            _fill_zero_adam_steps(loaded_optimizer)
            optimizer.load_state_dict(loaded_optimizer)
            _restore_adam_steps(optimizer)


def _torch_optimizers(optimizer: MegatronOptimizer) -> list[torch.optim.Optimizer]:
    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    return [each.optimizer for each in inner]


def allocate_adam_state(optimizer: MegatronOptimizer) -> None:
    """Give a never-stepped torch AdamW its state (zeros, step 0) so megatron can build its state dict.

    Without Apex or Transformer Engine, megatron reads the step count from the torch state (to save it, and to
    build the state dict to load into), which a never-stepped optimizer does not have yet.
    """
    for torch_optimizer in _torch_optimizers(optimizer):
        for group in torch_optimizer.param_groups:
            for param in group["params"]:
                state = torch_optimizer.state[param]
                if not state:
                    state["exp_avg"] = torch.zeros_like(param)
                    state["exp_avg_sq"] = torch.zeros_like(param)
                    state["step"] = torch.zeros((), dtype=torch.float32)


def _fill_zero_adam_steps(loaded: Any) -> None:
    """Put back the AdamW ``step`` (0) that megatron leaves out of a checkpoint saved before the first update.

    The non-distributed optimizer saves the step shared by all parameters only when it is truthy
    (``if step:``), so a step-0 checkpoint has moments but no step, which torch AdamW refuses to load.
    Walks the (possibly chained) loaded state dict; the per-parameter states sit under ``["state"]``.
    """
    if not isinstance(loaded, dict):
        return
    for param_state in (loaded.get("state") or {}).values():
        if isinstance(param_state, dict) and "exp_avg" in param_state and "step" not in param_state:
            param_state["step"] = torch.zeros((), dtype=torch.float32)
    for key, value in loaded.items():
        if key != "state":
            _fill_zero_adam_steps(value)


def _restore_adam_steps(optimizer: MegatronOptimizer) -> None:
    """Give every parameter its own torch AdamW ``step``, the count megatron saved in the param groups.

    Without Apex or Transformer Engine, megatron keeps the step count in ``param_groups[i]["step"]`` and does
    not reliably write it back into the per-parameter state (which torch AdamW reads for bias correction and
    increments in place, so each parameter needs its own tensor).
    """
    for torch_optimizer in _torch_optimizers(optimizer):
        for group in torch_optimizer.param_groups:
            if "step" not in group:
                continue
            for param in group["params"]:
                torch_optimizer.state[param]["step"] = torch.tensor(float(group["step"]), dtype=torch.float32)


def _save(sharded_state: dict[str, Any], directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save(sharded_state, str(directory), async_sharded_save=False)


def backend_info(model: BuiltModel, config: MegatronEngineConfig) -> dict[str, Any]:
    """What the manifest records for the merger (``drivetrain_engine_megatron.merger``) and for resuming."""
    hf_config = model.bridge.hf_config
    return {
        "format": FORMAT,
        "model_dir": MODEL_DIR,
        "optimizer_dir": OPTIMIZER_DIR,
        "optimizer_sharding": _OPTIMIZER_METADATA["distrib_optim_sharding_type"],
        "tensor_model_parallel_size": config.tensor_model_parallel_size,
        "pipeline_model_parallel_size": config.pipeline_model_parallel_size,
        "virtual_pipeline_model_parallel_size": config.virtual_pipeline_model_parallel_size,
        "expert_model_parallel_size": config.expert_model_parallel_size,
        "use_distributed_optimizer": config.use_distributed_optimizer,
        "hf_model_type": hf_config.model_type,
        "hf_architectures": list(getattr(hf_config, "architectures", None) or []),
        "vocab_size": model.vocab_size,
        "padded_vocab_size": model.bridge.padded_vocab_size,
        "value_head": bool(model.bridge.value_head),
        "key_convention": (
            "GPTModel names with decoder layers stacked (decoder.layers.<param>, leading layer axis over the "
            "global layers) and Transformer-Engine-style norm names "
            "(self_attention.linear_qkv.layer_norm_weight, mlp.linear_fc1.layer_norm_weight); tensors are full "
            "(TP shards concatenated, linear_fc1 = [gate; up]); map to HF with the mbridge bridge of hf_model_type: "
            "_weight_name_mapping_mcore_to_hf + _weight_to_hf_format; trim embedding/output rows to vocab_size; "
            "value_head: output_layer.weight/bias -> score.weight/bias"
        ),
    }

"""Build a megatron-core ``GPTModel`` from a Hugging Face config and weights through mbridge (its export back:
:mod:`.export`).

mbridge 0.15.1 knows how Qwen2, Llama, ... map onto ``GPTModel``, but assumes Transformer Engine and
transformers 4. Rather than patching it, :func:`make_bridge` subclasses the registered bridge class with
:class:`_DrivetrainBridgeMixin`, which

- builds the local (non-Transformer-Engine) layer spec with drivetrain's SDPA core attention
  (:mod:`.attention`), whose norms are separate modules (``input_layernorm``, ``pre_mlp_layernorm``, torch
  norms marked for sequence parallelism: :mod:`.norm`), and maps those names onto the Hugging Face norm weights;
- reads ``rope_theta`` from ``rope_parameters`` (transformers 5), refuses RoPE scaling it cannot map, and
  hands the base to the core attention, which rotates query and key itself (:mod:`.rope`: megatron's unfused
  packed-row rotation reads ``cu_seqlens`` on the host in every layer), so ``GPTModel`` has no position
  embedding of its own;
- pins the ``TransformerConfig`` values drivetrain relies on (sequence parallel off unless asked, per-token
  loss summation, no fused kernels) in the config's first build (mbridge's ``set_extra_args`` rebuilds it
  after a first build with megatron's defaults, which warn);
- keeps the weight-name mappings per bridge instance (mbridge edits its class-level dicts for tied embeddings);
- names the sequential expert MLP's weights as mbridge names grouped experts (:mod:`.moe`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from drivetrain_engine_core.backend import ConfigError
from mbridge import AutoBridge
from mbridge.core.bridge import _MODEL_REGISTRY, Bridge
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.transformer.spec_utils import ModuleSpec
from transformers import PretrainedConfig

from .attention import SdpaCoreAttention
from .moe import grouped_expert_name
from .norm import DrivetrainNorm

_NORM_MAPPING = {
    "input_layernorm.weight": "model.layers.{layer}.input_layernorm.weight",
    "pre_mlp_layernorm.weight": "model.layers.{layer}.post_attention_layernorm.weight",
    # The names a checkpoint stores them under: the local layer spec's sharded state dict keys the norms as
    # Transformer Engine fuses them. mbridge's mixture-of-experts bridges know the pre-MLP norm only under its
    # module name (a TE MoE layer keeps it separate), so merging a MoE step failed without these two.
    "self_attention.linear_qkv.layer_norm_weight": "model.layers.{layer}.input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "model.layers.{layer}.post_attention_layernorm.weight",
}
_VALUE_HEAD_MAPPING = {"output_layer.weight": "score.weight", "output_layer.bias": "score.bias"}


class _DrivetrainBridgeMixin:
    """Overrides that adapt an mbridge LLM bridge to the local layer spec and transformers 5."""

    hf_config: PretrainedConfig
    config: Any
    mpu: Any
    has_vp_stage = True  # megatron-core 0.16 layer specs take ``vp_stage``
    value_head = False
    """Whether ``output_layer`` is the value model's ``score`` head rather than ``lm_head``."""

    def __init__(
        self, *args: Any, transformer_overrides: dict[str, Any] | None = None, **kwargs: Any
    ) -> None:
        self.transformer_overrides = dict(transformer_overrides or {})
        # NOTE: mbridge's weight-name mappings are class attributes, and Qwen2Bridge's
        # ``_adjust_mapping_for_shared_weights`` (run by ``Bridge.__init__``) edits ``_DIRECT_MAPPING`` in place
        # for a tied model: every later bridge of that class or a subclass (Qwen3, ...) in the process would
        # then load ``output_layer`` from the embedding. Each bridge gets its own copies first.
        for name in _mapping_attributes(type(self)):
            setattr(self, name, copy.deepcopy(getattr(self, name)))
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]

    def _build_base_config(self, **kwargs: Any) -> Any:
        # NOTE: mbridge builds the config in ``Bridge.__init__``; passing drivetrain's values there, rather
        # than through ``set_extra_args`` afterwards, builds it once. ``cuda_graph_scope=[]`` is what
        # megatron-core 0.16 turns its own default ("full") into, after warning that it is deprecated: on every
        # config build, so once per engine and rank in every run's output.
        values = {"cuda_graph_scope": [], **kwargs, **self.transformer_overrides}
        return super()._build_base_config(**values)  # type: ignore[misc]

    def _get_transformer_layer_spec(self, vp_stage: int | None = None) -> Any:
        spec = get_gpt_decoder_block_spec(
            self.config,
            use_transformer_engine=False,
            normalization=self.config.normalization,
            vp_stage=vp_stage,
        )
        spec = copy.deepcopy(spec)
        # NOTE: the core attention rotates query and key itself (see .rope), so GPTModel gets no position
        # embedding and SelfAttention applies none.
        attention = ModuleSpec(module=SdpaCoreAttention, params={"rotary_base": rope_theta(self.hf_config)})
        for layer_spec in spec.layer_specs:
            layer_spec.submodules.self_attention.submodules.core_attention = attention
            layer_spec.submodules.input_layernorm = DrivetrainNorm
            layer_spec.submodules.pre_mlp_layernorm = DrivetrainNorm
        spec.layer_norm = DrivetrainNorm
        return spec

    def _get_gptmodel_args(self) -> dict[str, Any]:
        return {
            "vocab_size": self.hf_config.vocab_size,
            "max_sequence_length": self.hf_config.max_position_embeddings,
            "position_embedding_type": "none",
        }

    def _weight_name_mapping_mcore_local_to_global(
        self, model: torch.nn.Module, consider_ep: bool = True
    ) -> dict[str, str]:
        # NOTE: mbridge recognises expert weights, and splits or gathers them over expert-parallel ranks, by
        # their grouped names only; ``SequentialMLP``'s are renamed here so that the same code paths run. With
        # ``consider_ep`` a local expert is named by its global index (loading); without it by its local one
        # (export, where mbridge all-gathers each local index over the expert ranks and renames them itself).
        names = super()._weight_name_mapping_mcore_local_to_global(model, consider_ep=False)  # type: ignore[misc]
        experts = self.config.num_moe_experts or 0
        offset = self.mpu.ep_rank * experts // self.mpu.ep_size if consider_ep else 0
        return {local: grouped_expert_name(name, offset) for local, name in names.items()}

    def _weight_to_hf_format(
        self, mcore_weights_name: str, mcore_weights: torch.Tensor
    ) -> tuple[list[str], list[torch.Tensor]]:
        mcore_weights_name = grouped_expert_name(mcore_weights_name)
        if self._is_value_head(mcore_weights_name):
            # NOTE: mbridge trims any ``output_layer.weight`` to the vocabulary (asserting the padded size
            # first); the value head has one row, so a padded vocabulary failed every export.
            return [_VALUE_HEAD_MAPPING[mcore_weights_name]], [mcore_weights]
        return super()._weight_to_hf_format(mcore_weights_name, mcore_weights)  # type: ignore[misc]

    def _weight_to_mcore_format(
        self, mcore_weights_name: str, hf_weights: list[torch.Tensor]
    ) -> torch.Tensor:
        mcore_weights_name = grouped_expert_name(mcore_weights_name)
        if self._is_value_head(mcore_weights_name):
            # NOTE: not padded to the vocabulary either (see ``_weight_to_hf_format``); in the model's dtype.
            dtype = getattr(self, "dtype", None)
            return hf_weights[0] if dtype is None else hf_weights[0].to(dtype)
        return super()._weight_to_mcore_format(mcore_weights_name, hf_weights)  # type: ignore[misc]

    def _is_value_head(self, mcore_weights_name: str) -> bool:
        return self.value_head and mcore_weights_name in _VALUE_HEAD_MAPPING

    def _weight_name_mapping_mcore_to_hf(self, mcore_weights_name: str) -> list[str]:
        mcore_weights_name = grouped_expert_name(mcore_weights_name)
        if self._is_value_head(mcore_weights_name):
            return [_VALUE_HEAD_MAPPING[mcore_weights_name]]
        if mcore_weights_name == "output_layer.weight" and getattr(
            self.hf_config, "tie_word_embeddings", False
        ):
            # NOTE: a pipeline's last stage holds its own copy of a tied output layer, read from the embedding;
            # LLaMABridge mapped it to ``lm_head.weight``, which a tied checkpoint lacks (Qwen2Bridge remaps it).
            return super()._weight_name_mapping_mcore_to_hf("embedding.word_embeddings.weight")  # type: ignore[misc]
        for suffix, hf_name in _NORM_MAPPING.items():
            if mcore_weights_name.startswith("decoder.layers.") and mcore_weights_name.endswith(suffix):
                return [hf_name.format(layer=mcore_weights_name.split(".")[2])]
        return super()._weight_name_mapping_mcore_to_hf(mcore_weights_name)  # type: ignore[misc]


def _mapping_attributes(cls: type) -> list[str]:
    """Names of the bridge's weight-name mapping dicts (``_DIRECT_MAPPING``, ``_ATTENTION_MAPPING``, ...)."""
    return [name for name in dir(cls) if name.endswith("_MAPPING") and isinstance(getattr(cls, name), dict)]


def rope_theta(hf_config: PretrainedConfig) -> float:
    """The RoPE base of a transformers 4 or 5 config.

    Raises:
        ConfigError: the config uses a RoPE scaling type that ``GPTModel``'s plain rotary embedding cannot express.
    """
    parameters = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = parameters.get("rope_type", "default")
    if rope_type != "default":
        raise ConfigError(
            f"rope_type={rope_type!r} in {hf_config.model_type} config is not supported by the megatron backend "
            "(only 'default' RoPE maps onto GPTModel here); use the fsdp backend for this model."
        )
    theta = parameters.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is None:
        raise ConfigError(
            f"{hf_config.model_type} config has neither rope_parameters['rope_theta'] nor rope_theta."
        )
    return float(theta)


def refuse_sliding_window(hf_config: PretrainedConfig) -> None:
    """Refuse a model with sliding-window attention layers: mbridge maps no window onto ``GPTModel``, so its
    layers would attend to every earlier token.

    Raises:
        ConfigError: some layer of the model attends within a sliding window.
    """
    window = getattr(hf_config, "sliding_window", None)
    layer_types = getattr(hf_config, "layer_types", None)
    windowed = "sliding_attention" in layer_types if layer_types is not None else bool(window)
    if windowed:
        raise ConfigError(
            f"{hf_config.model_type} attends within a sliding window (sliding_window={window}), which the "
            "megatron backend does not apply (mbridge maps no window onto GPTModel); use the fsdp backend for "
            "this model."
        )


def refuse_heads_not_split(hf_config: PretrainedConfig, tensor_parallel_size: int) -> None:
    """Refuse a tensor-parallel size that does not divide the model's query and key/value heads.

    Megatron gives each tensor rank whole heads; an uneven split fails deep in megatron-core's config (an
    assertion naming none of drivetrain's options), and a checkpoint moved to such a layout never loads.

    Raises:
        ConfigError: ``tensor_parallel_size`` does not divide both head counts; names the sizes that do.
    """
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    if heads % tensor_parallel_size == 0 and kv_heads % tensor_parallel_size == 0:
        return
    dividing = [size for size in range(1, kv_heads + 1) if heads % size == 0 and kv_heads % size == 0]
    raise ConfigError(
        f"engine.tensor_model_parallel_size={tensor_parallel_size} splits each layer's attention heads over "
        f"{tensor_parallel_size} ranks, but this {hf_config.model_type} model has {heads} query heads and "
        f"{kv_heads} key/value heads; set tensor_model_parallel_size to one that divides both: {dividing}."
    )


def bridge_class(hf_config: PretrainedConfig, *, value_model: bool = False) -> type[Bridge]:
    """drivetrain's subclass of the mbridge bridge registered for ``hf_config.model_type``.

    Args:
        hf_config: the Hugging Face config.
        value_model: map ``output_layer`` onto the token-classification ``score`` head instead of ``lm_head``.

    Raises:
        ConfigError: mbridge has no bridge for this model type.
    """
    base = _MODEL_REGISTRY.get(hf_config.model_type)
    if base is None:
        raise ConfigError(
            f"model_type {hf_config.model_type!r} has no mbridge bridge; supported: "
            f"{sorted(AutoBridge.list_supported_models())}. Use the fsdp backend for this model."
        )
    return type(f"Drivetrain{base.__name__}", (_DrivetrainBridgeMixin, base), {"value_head": value_model})


def make_bridge(
    hf_config: PretrainedConfig,
    dtype: torch.dtype,
    transformer_overrides: dict[str, Any],
    *,
    value_model: bool = False,
    make_vocab_size_divisible_by: int | None = None,
) -> Bridge:
    """A bridge for ``hf_config`` whose ``TransformerConfig`` carries ``transformer_overrides``.

    A value model's output layer is its own value head, never the embedding: the bridge sees the config
    untied (verl builds critics with ``share_embeddings_and_output_weights=False`` too). Tied, a pipeline's
    last stage all-reduced the one-row head's gradient with the first stage's embedding gradient (a size
    mismatch: a hang or a crash at the first step) and checkpointed the head under the embedding's key.

    Call after the model-parallel groups exist: the bridge reads the parallel layout from megatron.
    """
    from megatron.core import parallel_state as mpu

    refuse_sliding_window(hf_config)
    refuse_heads_not_split(hf_config, mpu.get_tensor_model_parallel_world_size())
    if value_model and getattr(hf_config, "tie_word_embeddings", False):
        hf_config = copy.deepcopy(hf_config)
        hf_config.tie_word_embeddings = False
    cls = bridge_class(hf_config, value_model=value_model)
    return cls(
        hf_config,
        dtype=dtype,
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        transformer_overrides=transformer_overrides,
    )


def build_model_chunks(bridge: Bridge, vpp_size: int | None) -> list[torch.nn.Module]:
    """One ``GPTModel`` per virtual-pipeline stage on this rank, with the right pre/post-process flags."""
    from megatron.core import parallel_state as mpu

    provider: Callable[..., torch.nn.Module] = bridge._model_provider([])
    chunks = []
    for stage in range(vpp_size or 1):
        vp_stage = stage if vpp_size else None
        chunk = provider(
            pre_process=mpu.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=mpu.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            vp_stage=vp_stage,
        )
        # torch types Module.__setattr__ values as Tensor | Module, but plain attributes are allowed.
        chunk.vp_stage = vp_stage  # type: ignore[assignment]
        chunks.append(chunk)
    return chunks


def load_hf_weights(bridge: Bridge, chunks: list[torch.nn.Module], model_path: str) -> None:
    """Copy the Hugging Face safetensors weights under ``model_path`` into the (unwrapped) model chunks.

    Only tensor-parallel rank 0 of each pipeline stage reads the files, one tensor at a time, and scatters the
    TP slices to the other ranks of its group.
    """
    # NOTE: mbridge's default (memory_efficient=False) reads every weight of the stage into one dict first, so
    # TP rank 0 held a full copy of its stage on top of its shard: measured at TP2 on a 640 MB float32 model,
    # its initialize() grew by 1.96x the model size against 0.66x on TP rank 1 (0.93-1.09x vs 0.36-0.40x at
    # TP2 x PP2). Per-tensor reads bring TP rank 0 to 1.06x (0.57-0.73x at TP2 x PP2); what remains over the
    # other ranks is one full tensor and its TP slices.
    with torch.no_grad():
        bridge.load_weights(chunks, model_path, memory_efficient=True)

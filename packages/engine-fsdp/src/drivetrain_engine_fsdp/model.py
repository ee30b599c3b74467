"""Build the Hugging Face module the engine trains: weights, value head, LoRA adapters, activation checkpointing.

Two ways in, one result. :func:`build_model` is the full path: every rank loads (or initialises) the whole model
on CPU in float32 before sharding, and FSDP2 then keeps only its shard. ``meta_build.py`` builds the same module
on the meta device and ``hf_weights.py`` fills in only the local shards. Master weights stay float32; compute
dtype is FSDP2's mixed-precision policy (see ``wrap.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from drivetrain_engine_core.backend import ALL_LINEAR, ConfigError, LoraConfig, ModelConfig
from drivetrain_engine_core.kit import disable_dropout_in_config, disable_dropout_modules, peft_target_modules
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

VALUE_HEAD = "score"
"""Name of the value head of ``AutoModelForTokenClassification`` (``num_labels=1``), verl's critic layout."""


def check_model_dir(model_config: ModelConfig) -> Path:
    """The model directory of ``model_config``.

    Raises:
        FileNotFoundError: ``model_config.path`` has no ``config.json``.
    """
    path = Path(model_config.path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"model.path={model_config.path!r} has no config.json; point it at a local Hugging Face model "
            "directory (one written by save_pretrained)."
        )
    return path


def auto_class(model_config: ModelConfig) -> Any:
    """The transformers auto class of the model type: a causal LM, or token classification for values."""
    if model_config.model_type == "language_model":
        return AutoModelForCausalLM
    return AutoModelForTokenClassification


VALUE_MODEL_CONFIG = {"num_labels": 1, "classifier_dropout": 0.0}
"""What a value model's config gets: one label (a scalar per token) and no dropout before the head.

NOTE: transformers' token-classification head falls back to ``Dropout(0.1)`` when the config names neither
``classifier_dropout`` nor ``hidden_dropout`` (Qwen2, Llama, Mistral, Gemma): a critic trained with dropout on
the hidden states its values come from (noisy value loss, shrunk predictions), unlike its eval-mode values and
the Megatron backend's head. verl's critics set it to 0 too."""


def hf_config(model_config: ModelConfig) -> Any:
    """The model's transformers config; a value model's as :data:`VALUE_MODEL_CONFIG` sets it, without dropout
    under ``model.disable_dropout``.

    NOTE: set as attributes after loading: transformers 5 drops keyword arguments its config class does not
    declare (``classifier_dropout`` on a Qwen2 config).
    """
    config = AutoConfig.from_pretrained(model_config.path, trust_remote_code=model_config.trust_remote_code)
    if model_config.model_type == "value_model":
        for name, value in VALUE_MODEL_CONFIG.items():
            setattr(config, name, value)
    if model_config.disable_dropout:
        disable_dropout_in_config(config)
    return config


def build_model(model_config: ModelConfig, *, attn_implementation: str, seed: int) -> Any:
    """Load (or initialise) the whole model of ``model_config`` on CPU in float32, on every rank.

    Args:
        model_config: path, model type, LoRA and activation-checkpointing settings.
        attn_implementation: the transformers attention implementation (``sdpa`` or a registered name).
        seed: seeds fresh weights (a value head, LoRA adapters, ``from_config_only``) identically on every rank.

    Returns:
        The module to shard: a causal LM, or a token-classification model with one label for values; wrapped
        in a ``PeftModel`` when LoRA is configured.

    Raises:
        FileNotFoundError: ``model_config.path`` has no ``config.json``.
    """
    check_model_dir(model_config)
    torch.manual_seed(seed)
    common = {
        "dtype": torch.float32,
        "attn_implementation": attn_implementation,
        "trust_remote_code": model_config.trust_remote_code,
    }
    if model_config.from_config_only:
        model = auto_class(model_config).from_config(hf_config(model_config), **common)
    else:
        model = auto_class(model_config).from_pretrained(
            model_config.path, config=hf_config(model_config), **common
        )
    return add_training_wrappers(model, model_config)


def add_training_wrappers(model: Any, model_config: ModelConfig) -> Any:
    """Dropout modules off, activation checkpointing and LoRA adapters, as ``model_config`` asks; returns the
    module to shard. LoRA's own dropout (``lora.dropout``) stays as asked."""
    if model_config.disable_dropout:
        disable_dropout_modules(model)
    if model_config.gradient_checkpointing:
        # Non-reentrant checkpointing composes with FSDP2's hooks and with frozen (LoRA) base weights.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if model_config.lora is not None:
        model = apply_lora(model, model_config.lora, value_model=model_config.model_type == "value_model")
    return model


def apply_lora(model: nn.Module, lora: LoraConfig, *, value_model: bool) -> Any:
    """Wrap ``model`` with PEFT LoRA adapters; the base weights are frozen.

    A value model also trains its (fresh) value head in full, through PEFT's ``modules_to_save``.

    Raises:
        ConfigError: a target is not a plain linear layer (see :func:`_refuse_non_linear_targets`).
    """
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    peft_config = PeftLoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,  # type: ignore[arg-type]  # PEFT annotates int but scales by alpha / r
        target_modules=peft_target_modules(lora.target_modules),
        lora_dropout=lora.dropout,
        bias="none",
        modules_to_save=[VALUE_HEAD] if value_model else None,
    )
    linear_names = _linear_suffixes(model)
    try:
        wrapped = get_peft_model(model, peft_config)
    except ValueError as e:  # PEFT's NoMatchingPeftModuleError when a target matches no module
        raise ConfigError(
            f"model.lora.target_modules={list(lora.target_modules)} matches no module of {type(model).__name__} "
            f"({e}); its linear layers are named {linear_names}, or write [{ALL_LINEAR}]."
        ) from e
    _refuse_non_linear_targets(wrapped, lora)
    _refuse_tied_output_adapter(wrapped, lora)
    return wrapped


def _linear_suffixes(model: nn.Module) -> list[str]:
    """The distinct last name parts of the model's linear layers (what ``target_modules`` matches)."""
    return sorted(
        {name.rpartition(".")[2] for name, module in model.named_modules() if isinstance(module, nn.Linear)}
    )


def _refuse_non_linear_targets(model: Any, lora: LoraConfig) -> None:
    """Every adapted module must be a LoRA ``Linear`` without ``fan_in_fan_out``.

    NOTE: export, the weight hand-off and ``drivetrain ckpt merge`` fold ``B @ A`` into ``<module>.weight`` and
    name adapters ``lora_A/lora_B.weight``; PEFT's embedding adapters (``lora_embedding_A``, no ``.weight``)
    were written as junk base weights and never folded, and GPT-2's Conv1D layers need a transpose no path made.
    """
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.lora import LoraLayer

    refused = sorted(
        f"{name} ({type(module.get_base_layer()).__name__})"
        for name, module in model.get_base_model().named_modules()
        if isinstance(module, LoraLayer)
        and (not isinstance(module, LoraLinear) or getattr(module, "fan_in_fan_out", False))
    )
    if refused:
        raise ConfigError(
            f"model.lora.target_modules={list(lora.target_modules)} adapts layers that are not plain linear "
            f"layers: {refused[:3]}{' ...' if len(refused) > 3 else ''}. drivetrain exports, hands off and merges "
            "LoRA for nn.Linear projections only; target those (e.g. q_proj, k_proj, v_proj, o_proj, gate_proj, "
            "up_proj, down_proj)."
        )


def _refuse_tied_output_adapter(model: Any, lora: LoraConfig) -> None:
    """No adapter on an output layer tied to the input embeddings.

    NOTE: a merged model holds one matrix for both (``tie_word_embeddings``), so folding the adapter's update
    into ``lm_head`` either changed the embeddings too or, as ``ckpt merge`` and the hand-off wrote it, was
    dropped with the tied copy: the merged model silently lost what the adapter learnt there.
    """
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    if getattr(base.config, "tie_word_embeddings", False) and isinstance(
        base.get_output_embeddings(), LoraLayer
    ):
        raise ConfigError(
            f"model.lora.target_modules={list(lora.target_modules)} adapts the output layer, which this model "
            "ties to its input embeddings (tie_word_embeddings=true): a merged model keeps one matrix for both and "
            "the adapter's update to it would be lost. Drop the output layer (lm_head) from lora.target_modules."
        )


def decoder_layers(model: Any) -> list[nn.Module]:
    """The repeated transformer blocks, found by the class names transformers marks as not splittable.

    Raises:
        ConfigError: the model declares no ``_no_split_modules`` or none of them is present.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(getattr(base, "_no_split_modules", None) or ())
    layers = [module for module in model.modules() if type(module).__name__ in names]
    if not layers:
        raise ConfigError(
            f"{type(base).__name__} declares no decoder layer class (_no_split_modules={sorted(names)}) found in the "
            "model; FSDP2 needs one unit per layer. Use a transformers model class that sets _no_split_modules."
        )
    return layers


def hf_class_name(model: Any) -> str:
    """The transformers class of the (possibly PEFT-wrapped) model, recorded in checkpoint manifests."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return type(base).__name__

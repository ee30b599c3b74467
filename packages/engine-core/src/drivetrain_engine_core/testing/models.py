"""Tiny Hugging Face model directories built from configs, for tests that must load models for real.

The directory is written with ``save_pretrained`` (safetensors), so engines under test exercise their
normal ``from_pretrained`` loading path. :func:`lean_model_dir` turns such a model into one whose sampled turns
are predictable (the multi-turn and episode tests' model).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

from drivetrain_engine_core.testing.tokenizer import build_tiny_tokenizer

MOE_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3_moe": {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "norm_topk_prob": True,
    },
    "qwen2_moe": {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 32,
    },
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
}
"""Mixture-of-experts families and their tiny expert settings: 4 experts, top-2 (Qwen3-MoE and Mixtral route
every layer; Qwen2-MoE adds a gated shared expert)."""

ARCHITECTURES = ("qwen2", "llama", *MOE_CONFIGS)
MODEL_TYPES = ("language_model", "value_model")

TINY_CONFIG: dict[str, Any] = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 64,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
    "attention_dropout": 0.0,
    "hidden_dropout": 0.0,
    "classifier_dropout": 0.0,
    "dtype": "float32",
}


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"make_tiny_model_dir: {name}={value!r} is not supported; use one of {choices}.")


def make_tiny_model_dir(
    path: str | Path,
    *,
    arch: str = "qwen2",
    model_type: str = "language_model",
    seed: int = 0,
    with_tokenizer: bool = True,
    **config_overrides: Any,
) -> Path:
    """Write a tiny, randomly initialised model (and its tokenizer) to ``path``.

    Args:
        path: Directory to write (created if missing).
        arch: ``"qwen2"``, ``"llama"`` or a mixture-of-experts family of :data:`MOE_CONFIGS`.
        model_type: ``"language_model"`` (``AutoModelForCausalLM``) or ``"value_model"``
            (``AutoModelForTokenClassification`` with one label, verl's critic convention).
        seed: Seed of the weight initialisation; the same seed gives the same weights.
        with_tokenizer: Also save the tiny tokenizer whose size sets the vocabulary.
        **config_overrides: Config fields to change (e.g. ``hidden_size=64``).

    Returns:
        ``path`` as a ``Path``.

    Raises:
        ValueError: ``arch`` or ``model_type`` is not one of the supported values.
    """
    _check_choice("arch", arch, ARCHITECTURES)
    _check_choice("model_type", model_type, MODEL_TYPES)
    path = Path(path)
    tokenizer = build_tiny_tokenizer()
    fields = {
        **TINY_CONFIG,
        **MOE_CONFIGS.get(arch, {}),
        "vocab_size": len(tokenizer),
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        **config_overrides,
    }
    if model_type == "value_model":
        fields["num_labels"] = 1
    config = AutoConfig.for_model(arch, **fields)
    torch.manual_seed(seed)
    auto_class = AutoModelForCausalLM if model_type == "language_model" else AutoModelForTokenClassification
    model = auto_class.from_config(config, dtype=torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    if with_tokenizer:
        tokenizer.save_pretrained(path)
    return path


LEAN_CONSTANT = 30.0
"""What :func:`lean_model_dir` adds to dimension 0 of every token embedding: large enough that, after the
layers and the final norm, dimension 0 dominates every hidden state whatever the context."""


def lean_model_dir(path: str | Path, tokenizer: Any, leans: Mapping[str, float]) -> Path:
    """Make the causal language model saved at ``path`` lean towards the tokens of ``leans``, whatever the context.

    Every token embedding gets :data:`LEAN_CONSTANT` added in dimension 0, and the output layer reads dimension
    0 only for the tokens of ``leans`` (each with its weight; every other token's weight there is 0): those
    tokens are the likely ones at every position, in the order of their weights, so a test knows what sampled
    turns hold (e.g. a turn end, so that turns end; characters of the words a game scores) without training.
    The model is written back to ``path`` (safetensors); a tokenizer saved there is left as it is.

    Args:
        path: A causal language model directory, e.g. from :func:`make_tiny_model_dir` (untied embeddings).
        tokenizer: The tokenizer whose ids the tokens of ``leans`` are looked up with.
        leans: Each token (as the tokenizer spells it, e.g. ``"<|im_end|>"``) and its weight, e.g. 0.75-1.0.

    Returns:
        ``path`` as a ``Path``.

    Raises:
        ValueError: a token of ``leans`` is not in the tokenizer's vocabulary, or the model ties its embeddings.
    """
    path = Path(path)
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in leans}
    unknown = sorted(t for t, i in ids.items() if i is None or i == tokenizer.unk_token_id)
    if unknown:
        raise ValueError(
            f"lean_model_dir: {unknown} are not tokens of the tokenizer; lean towards single tokens of its "
            "vocabulary (tokenizer.convert_tokens_to_ids(token) must find them)."
        )
    model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if model.config.tie_word_embeddings:
        raise ValueError(
            f"lean_model_dir: the model at {path} ties its output layer to its embeddings, so the output layer "
            "cannot read dimension 0 apart; write it with tie_word_embeddings=False (make_tiny_model_dir's default)."
        )
    with torch.no_grad():
        model.get_input_embeddings().weight[:, 0] += LEAN_CONSTANT
        head = model.get_output_embeddings().weight
        head[:, 0] = 0.0
        for token, weight in leans.items():
            head[ids[token], 0] = weight
    model.save_pretrained(path, safe_serialization=True)
    return path

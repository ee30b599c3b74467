"""The trained model as a plain Hugging Face folder: the engine's exported weights in the source model's class.

``export_weights()`` is a collective (every rank streams the full tensors); rank 0 loads them into the model
class of ``config.json`` and, for ``<run>/final_model``, writes weights (safetensors), config, generation
config and the tokenizer that produced the training inputs, so ``from_pretrained`` + ``tokenizer(prompt)`` +
``generate`` reproduce what the run measured.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from drivetrain_engine_core.backend import Engine
from drivetrain_engine_core.kit import distributed

from ..hf_layout import CheckpointLayout
from .rank_zero_write import rank_zero_write
from .stop_tokens import stop_token_ids

FINAL_MODEL_DIR = "final_model"


def gather_weights(engine: Engine) -> dict[str, torch.Tensor] | None:
    """The engine's full weights by Hugging Face name, on CPU on rank 0 (``None`` elsewhere); collective."""
    weights = {}
    for name, tensor in engine.export_weights():
        if distributed.rank() == 0:
            weights[name] = tensor.detach().to("cpu", copy=True)
    return weights if distributed.rank() == 0 else None


def gather_hf_model(engine: Engine, model_path: str) -> Any | None:
    """The engine's current weights in a Hugging Face model on rank 0 (``None`` elsewhere); collective."""
    weights = gather_weights(engine)
    trust = engine.model_config.trust_remote_code
    return None if weights is None else _hf_model(model_path, weights, trust_remote_code=trust)


def save_final_model(
    engine: Engine, model_path: str, tokenizer: Any, target: Path, *, max_new_tokens: int
) -> None:
    """Write the trained model to ``target`` on rank 0 (collective: every rank exports its shards).

    The generation config asks for what evaluation does (greedy, ``max_new_tokens``), with the tokenizer's
    special tokens; its ``eos_token_id`` lists the chat template's turn end beside the EOS
    (:func:`~.stop_tokens.stop_token_ids`), so ``generate`` stops where a chat answer ends.
    """
    model = gather_hf_model(engine, model_path)
    with rank_zero_write("the final model", target):
        if model is not None:
            pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
            stops = stop_token_ids(tokenizer)
            generation = model.generation_config
            generation.update(
                do_sample=False,
                max_new_tokens=max_new_tokens,
                bos_token_id=tokenizer.bos_token_id,
                eos_token_id=stops if len(stops) > 1 else tokenizer.eos_token_id,
                pad_token_id=pad_id,
            )
            model.save_pretrained(target, safe_serialization=True)
            tokenizer.save_pretrained(target)


def _hf_model(model_path: str, weights: dict[str, torch.Tensor], *, trust_remote_code: bool) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, trust_remote_code=trust_remote_code)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    # NOTE: the export is in checkpoint layout (one tensor per expert of a mixture-of-experts model), which
    # transformers 5 fuses in the module: load_state_dict refused it.
    try:
        CheckpointLayout(model).load(weights, optional=tied)
    except ValueError as e:
        raise RuntimeError(
            f"exported weights do not match {config.model_type} from {model_path}: {e}; the backend's "
            "export_weights() must yield Hugging Face checkpoint names."
        ) from e
    return model.eval()

"""The body of ``Engine.weight_buckets``: pick the tensors to hand off (merged weights or LoRA adapters alone,
with the PEFT adapter config) and pack them into buckets (:mod:`.stream`), full or as a delta on a version sent before (:mod:`.history`).

The engine passes its export hooks in as callables, so this module needs no engine internals.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from .._checkpoint.peft import peft_adapter_config
from .._config import ModelConfig
from .._errors import EngineStateError
from .bucket import LORA_MODES, LoraMode, WeightBucket
from .local_shards import SentShards, ShardedWeight

Export = Callable[[], Iterator[tuple[str, torch.Tensor]]]
ShardedExport = Callable[[], Iterator[ShardedWeight]]


def engine_weight_buckets(
    *,
    model_config: ModelConfig,
    export_weights: Export,
    export_adapter_weights: Export,
    sent: SentShards,
    export_weight_shards: ShardedExport | None = None,
    version: int,
    base_version: int | None,
    bucket_bytes: int,
    dtype: torch.dtype | None,
    lora: LoraMode,
) -> Iterator[WeightBucket]:
    """Buckets of the merged weights (``export_weights``) or of the adapters alone (``export_adapter_weights``,
    with the PEFT config in every bucket), a delta on ``base_version`` where ``sent`` remembers it; see
    ``Engine.weight_buckets`` for the arguments. Merged weights of a backend that exports its local shards
    (``export_weight_shards``) gather only the tensors that changed (:mod:`.local_shards`).

    Raises:
        EngineStateError: ``lora="adapter"`` on an engine without LoRA adapters.
        ValueError: ``lora`` is not one of ``merged``/``adapter``, or ``bucket_bytes`` is not positive.
    """
    if lora not in LORA_MODES:
        raise ValueError(f"weight_buckets(lora={lora!r}): choose one of {list(LORA_MODES)}.")
    if lora == "merged" and export_weight_shards is not None:
        yield from sent.stream(
            export_weight_shards(),
            version=version,
            base_version=base_version,
            bucket_bytes=bucket_bytes,
            dtype=dtype,
            lora=lora,
        )
        return
    adapter_config = None
    if lora == "adapter":
        adapter_config = adapter_config_of(model_config)
        tensors = export_adapter_weights()
    else:
        tensors = export_weights()
    yield from sent.versions.stream(
        tensors,
        version=version,
        base_version=base_version,
        bucket_bytes=bucket_bytes,
        dtype=dtype,
        lora=lora,
        adapter_config=adapter_config,
    )


def adapter_config_of(model_config: ModelConfig) -> dict[str, Any]:
    """The PEFT adapter config of the engine's LoRA adapters, handed off with them."""
    lora = model_config.lora
    if lora is None:
        raise EngineStateError(
            "weight_buckets(lora='adapter') needs LoRA adapters, and this engine trains the full model "
            "(model.lora is unset); hand off with lora='merged'."
        )
    value_model = model_config.model_type == "value_model"
    return peft_adapter_config(
        {**lora.__dict__, "target_modules": list(lora.target_modules)},
        model_type=model_config.model_type,
        model_path=str(Path(model_config.path).resolve()),
        modules_to_save=["score"] if value_model else [],
    )

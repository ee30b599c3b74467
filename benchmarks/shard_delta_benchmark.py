"""Bytes a weight hand-off gathers and sends on two ranks (FSDP, Megatron TP2), full vs delta, where whole tensors
stay put (prints JSON).

A delta stream decided on gathered tensors saves the wire's bytes but not the gather's; with the
``sharded_export`` capability (FSDP, Megatron) each rank digests its local shards, one all-reduce of flags agrees
what changed, and only that is gathered (core's ``handoff.local_shards``). Three cases, each one training step
after a full version 0, then version 1 as a delta on 0 and version 2 in full:

- ``frozen_layers``: a full fine-tune with every decoder layer but the last frozen (embeddings, head, norms too);
- ``lora_merged``: LoRA (rank 8) on ``q_proj``/``v_proj``, handed off merged (the base stays put, so only the
  adapted weights change);
- ``megatron_tp2_frozen_layers``: ``frozen_layers`` on Megatron at tensor-parallel size 2 (no weight decay:
  megatron's optimizer steps the parameters frozen after it was built with zero gradients, which weight decay
  alone would move).

Per stream it reports the sender's ``engine.sent_weights.last`` (bytes of full tensors gathered, bytes packed
into buckets) and rank 0's wall seconds; ``whole_gather_delta`` is what the delta cost before (every tensor
gathered, the same bytes sent). The model: the tiny Qwen2 widened to a few MB (4.2 MB in float32).

Run: ``uv run --all-packages python benchmarks/shard_delta_benchmark.py`` (two CPU processes, gloo; about a
minute; CPU seconds on a shared machine are no timing claims).
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

MODEL = {"hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 4, "vocab_size": 1024}
LAST_LAYER = f"model.layers.{MODEL['num_hidden_layers'] - 1}."


def timed_stream(engine: Any, **options: Any) -> dict[str, Any]:
    """One ``weight_buckets`` stream consumed like a receiver would; its bytes and rank 0's seconds."""
    started = time.perf_counter()
    for bucket in engine.weight_buckets(bucket_bytes=1 << 20, **options):
        del bucket
    cost = engine.sent_weights.last
    return {"gathered": cost.gathered, "sent": cost.sent, "seconds": round(time.perf_counter() - started, 4)}


def measure(engine: Any) -> dict[str, Any]:
    from drivetrain_engine_core.job import shard_data
    from drivetrain_engine_core.testing import random_batch, token_mean_nll

    rank, world_size = engine.data_parallel_rank, engine.data_parallel_size
    timed_stream(engine, version=0)
    batch = random_batch(
        vocab_size=MODEL["vocab_size"], prompt_lengths=[8] * 4, response_lengths=[8] * 4, seed=0
    )
    with engine.train_mode():
        engine.train_batch(shard_data(batch, rank, world_size), token_mean_nll)
    delta = timed_stream(engine, version=1, base_version=0)
    full = timed_stream(engine, version=2)
    return {
        "full": full,
        "delta": delta,
        "whole_gather_delta": {"gathered": full["gathered"], "sent": delta["sent"]},
        "gathered_fraction": round(delta["gathered"] / full["gathered"], 4),
    }


def two_ranks(rank: int, world_size: int, model_dir: str) -> dict[str, Any]:
    from drivetrain_engine_core.backend import LoraConfig, ModelConfig, OptimizerConfig
    from drivetrain_engine_core.job import MicroBatchConfig
    from drivetrain_engine_fsdp.config import FSDPEngineConfig
    from drivetrain_engine_fsdp.engine import FSDPEngine

    def engine(lora: LoraConfig | None) -> Any:
        built = FSDPEngine(
            model_config=ModelConfig(path=model_dir, lora=lora),
            engine_config=FSDPEngineConfig(micro_batch=MicroBatchConfig(micro_batch_size=2)),
            optimizer_config=OptimizerConfig(lr=1e-3),
        )
        built.initialize()
        return built

    frozen = engine(None)
    for name, parameter in frozen.module.named_parameters():
        parameter.requires_grad_(name.startswith(LAST_LAYER))
    lora = engine(LoraConfig(rank=8, alpha=16.0, target_modules=("q_proj", "v_proj")))
    return {"frozen_layers": measure(frozen), "lora_merged": measure(lora)}


def megatron_tp2(rank: int, world_size: int, model_dir: str) -> dict[str, Any]:
    from drivetrain_engine_core.backend import ModelConfig, OptimizerConfig
    from drivetrain_engine_core.job import MicroBatchConfig
    from drivetrain_engine_megatron import MegatronEngine, MegatronEngineConfig

    del rank, world_size
    engine = MegatronEngine(
        model_config=ModelConfig(path=model_dir),
        engine_config=MegatronEngineConfig(
            micro_batch=MicroBatchConfig(micro_batch_size=2), tensor_model_parallel_size=2
        ),
        optimizer_config=OptimizerConfig(lr=1e-3, weight_decay=0.0),
    )
    engine.initialize()
    for chunk in engine._model.unwrapped:
        chunk.requires_grad_(False)
        for layer in chunk.decoder.layers:
            layer.requires_grad_(layer.layer_number == MODEL["num_hidden_layers"])
    return {"megatron_tp2_frozen_layers": measure(engine)}


def main() -> None:
    from drivetrain_engine_core.testing import make_tiny_model_dir, run_distributed

    with tempfile.TemporaryDirectory() as folder:
        model_dir = make_tiny_model_dir(Path(folder) / "model", **MODEL)
        model_bytes = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
        ranks = run_distributed(two_ranks, str(model_dir), world_size=2, timeout_s=600)
        megatron = run_distributed(megatron_tp2, str(model_dir), world_size=2, timeout_s=600)
    report = {"world_size": 2, "model_file_bytes": model_bytes, **ranks[0], **megatron[0]}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

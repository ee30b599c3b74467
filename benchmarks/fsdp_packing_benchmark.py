"""Benchmark of the FSDP engine's packed (no-padding) path (prints one JSON object).

Two questions, on one rank with a small Qwen2 model built from a config:

1. Packing: how much faster is a train step on packed rows (per-sequence attention) than on padded rows,
   compared with the ideal speed-up ``padded tokens / real tokens``? Lengths are long-tailed (lognormal,
   clipped), scaled to the small model.
2. Overhead: how much slower is ``engine.train_batch`` than a bare Hugging Face forward + backward + AdamW
   step over the same packed tokens (same attention function, same loss)?

Each timing is the best of ``REPEATS`` steps after ``WARMUP`` steps (the minimum is the least disturbed by
other processes on a shared machine), in wall time and in process CPU time; the three step functions take
turns, so that load hits them alike. Targets: packed speed-up >= 90% of the
ideal, engine overhead <= 5%.

Run: ``.venv/bin/python benchmarks/fsdp_packing_benchmark.py``
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from drivetrain_engine_core.config import MicroBatchConfig, ModelConfig, OptimizerConfig
from drivetrain_engine_core.data.batch import make_batch
from drivetrain_engine_core.data.packing import next_token_labels, pack_micro_batch
from drivetrain_engine_core.testing.losses import token_mean_nll
from drivetrain_engine_core.testing.models import make_tiny_model_dir
from drivetrain_engine_fsdp.attention import register_varlen_attention
from drivetrain_engine_fsdp.config import FSDPEngineConfig
from drivetrain_engine_fsdp.engine import FSDPEngine
from drivetrain_engine_fsdp.inputs import packed_row_kwargs
from transformers import AutoModelForCausalLM

NUM_SEQUENCES = 16
MEDIAN_LENGTH, MIN_LENGTH, MAX_LENGTH = 48, 8, 512
MODEL = {
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": MAX_LENGTH,
}
WARMUP, REPEATS = 2, 8
OPTIMIZER = OptimizerConfig(lr=1e-4, clip_grad=None, weight_decay=0.0)
SEED = 0


def long_tailed_lengths(seed: int = SEED) -> list[int]:
    """Lognormal lengths around ``MEDIAN_LENGTH``, clipped; the longest is set to ``MAX_LENGTH`` (the tail)."""
    generator = torch.Generator().manual_seed(seed)
    normal = torch.randn(NUM_SEQUENCES, generator=generator, dtype=torch.float64)
    lengths = (MEDIAN_LENGTH * torch.exp(normal)).clamp(MIN_LENGTH, MAX_LENGTH).round().long()
    lengths[0] = MAX_LENGTH
    return lengths.tolist()


def build_batch(lengths: list[int], vocab_size: int):
    generator = torch.Generator().manual_seed(SEED)
    return make_batch([torch.randint(0, vocab_size, (n,), generator=generator) for n in lengths])


def best_times(steps: dict[str, Callable[[], None]], clock: Callable[[], float]) -> dict[str, float]:
    """Best time of each step function on ``clock``, measured in alternation after a warm-up."""
    for step in steps.values():
        for _ in range(WARMUP):
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(REPEATS):
        for name, step in steps.items():
            start = clock()
            step()
            times[name].append(clock() - start)
    return {name: min(values) for name, values in times.items()}


def comparisons(times: dict[str, float], ideal: float) -> dict[str, float]:
    speedup = times["padded"] / times["packed"]
    return {
        "packed_step_s": round(times["packed"], 4),
        "padded_step_s": round(times["padded"], 4),
        "bare_hf_step_s": round(times["bare"], 4),
        "packed_speedup": round(speedup, 3),
        "fraction_of_ideal": round(speedup / ideal, 3),
        "engine_overhead": round(times["packed"] / times["bare"] - 1.0, 4),
    }


def engine_step(model_dir: Path, batch, use_remove_padding: bool) -> Callable[[], None]:
    engine = FSDPEngine(
        model_config=ModelConfig(path=str(model_dir), use_remove_padding=use_remove_padding),
        engine_config=FSDPEngineConfig(micro_batch=MicroBatchConfig(micro_batch_size=NUM_SEQUENCES)),
        optimizer_config=OPTIMIZER,
    )
    engine.initialize()

    def step() -> None:
        with engine.train_mode():
            engine.train_batch(batch, token_mean_nll)

    return step


def bare_step(model_dir: Path, batch) -> Callable[[], None]:
    """Plain transformers + AdamW on the packed row, same attention function and loss as the engine."""
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation=register_varlen_attention()
    )
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=OPTIMIZER.lr, weight_decay=0.0)
    row = pack_micro_batch(batch)
    labels = next_token_labels(row.input_ids[0], row.cu_seqlens)
    mask = torch.ones_like(labels, dtype=torch.bool)
    mask[row.offsets[1:] - 1] = False  # the last token of a sequence predicts nothing

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        logits = model(**packed_row_kwargs(row)).logits[0]
        log_probs = torch.log_softmax(logits.float(), dim=-1).gather(-1, labels[:, None]).squeeze(-1)
        (-(log_probs * mask).sum() / mask.sum()).backward()
        optimizer.step()

    return step


def main() -> None:
    torch.manual_seed(SEED)
    model_dir = make_tiny_model_dir(Path(tempfile.mkdtemp()) / "model", **MODEL)
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    lengths = long_tailed_lengths()
    batch = build_batch(lengths, vocab_size)
    real, padded = sum(lengths), len(lengths) * max(lengths)
    steps = {
        "packed": engine_step(model_dir, batch, use_remove_padding=True),
        "padded": engine_step(model_dir, batch, use_remove_padding=False),
        "bare": bare_step(model_dir, batch),
    }
    ideal = padded / real
    result = {
        "device": "cpu",
        "threads": torch.get_num_threads(),
        "model": MODEL,
        "num_sequences": len(lengths),
        "real_tokens": real,
        "padded_tokens": padded,
        "ideal_speedup": round(ideal, 3),
        # Wall time is what a user sees; process CPU time is far less disturbed by other processes.
        "wall_time": comparisons(best_times(steps, time.perf_counter), ideal),
        "cpu_time": comparisons(best_times(steps, time.process_time), ideal),
        "targets": {"fraction_of_ideal": ">= 0.90", "engine_overhead": "<= 0.05"},
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

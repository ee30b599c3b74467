"""Benchmark of the micro-batching hot path: ``split_micro_batches`` + ``MicroBatches.restore`` (one JSON line).

Two batches: 64 sequences of 16-64 tokens (a tiny-model step) and the partition benchmark's 4096 sequences
(~4M tokens). Each is split fixed (one micro-batch covering the batch, and chunks of a quarter / 256
sequences) and dynamic (token cap), then per-token outputs shaped like a backend's (``log_probs`` and a
per-sequence score) are restored to the original order. Reports best-of-N wall and CPU milliseconds of the
split and of the restore, single process (the count all-reduce is a no-op).

Run: ``.venv/bin/python benchmarks/micro_batch_benchmark.py``
"""

from __future__ import annotations

import json
import time

import torch
from drivetrain_engine_core._data import split_micro_batches
from drivetrain_engine_core.job import MicroBatchConfig, jagged, make_batch
from partition_benchmark import make_lengths
from tensordict import TensorDict

REPEATS = 5


def make_token_batch(lengths: torch.Tensor) -> TensorDict:
    """A batch with ``input_ids``, ``advantages`` (per token) and ``uid`` (per sequence)."""
    gen = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, 1000, (int(n),), generator=gen) for n in lengths]
    return make_batch(
        ids, advantages=[torch.randn(int(n), generator=gen) for n in lengths], uid=torch.arange(len(ids))
    )


def fake_outputs(micro_batches) -> list[TensorDict]:
    """What a backend returns per micro-batch: per-token log-probs and one score per sequence."""
    return [
        TensorDict(
            log_probs=jagged(mb["input_ids"].values().float(), mb["input_ids"].offsets()),
            score=mb["uid"].float(),
            batch_size=mb.batch_size,
        )
        for mb in micro_batches.batches
    ]


def best_ms(fn) -> tuple[float, float, object]:
    """Best wall-clock and CPU milliseconds of ``fn()`` over ``REPEATS`` runs, and its result."""
    best_wall, best_cpu, result = float("inf"), float("inf"), None
    for _ in range(REPEATS):
        wall, cpu = time.perf_counter(), time.process_time()
        result = fn()
        best_wall = min(best_wall, time.perf_counter() - wall)
        best_cpu = min(best_cpu, time.process_time() - cpu)
    return best_wall * 1e3, best_cpu * 1e3, result


def measure(batch: TensorDict, config: MicroBatchConfig) -> dict[str, float]:
    """Split and restore timings of ``batch`` under ``config``, after checking the restore is exact."""
    split_ms, split_cpu_ms, mbs = best_ms(lambda: split_micro_batches(batch, config))
    outputs = fake_outputs(mbs)
    restore_ms, restore_cpu_ms, restored = best_ms(lambda: mbs.restore(outputs))
    if not torch.equal(restored["log_probs"].values(), batch["input_ids"].values().float()):
        raise RuntimeError("restore did not give back the original order")
    return {
        "micro_batches": len(mbs.batches),
        "split_ms": round(split_ms, 2),
        "restore_ms": round(restore_ms, 2),
        "split_cpu_ms": round(split_cpu_ms, 2),
        "restore_cpu_ms": round(restore_cpu_ms, 2),
    }


def main() -> None:
    torch.set_num_threads(1)
    small = make_token_batch(torch.randint(16, 65, (64,), generator=torch.Generator().manual_seed(0)))
    large = make_token_batch(make_lengths())
    cases = {
        "64_seq_one_micro_batch": (small, MicroBatchConfig(micro_batch_size=64)),
        "64_seq_fixed_16": (small, MicroBatchConfig(micro_batch_size=16)),
        "64_seq_dynamic_512": (small, MicroBatchConfig(micro_batch_size=None, max_tokens=512)),
        "4096_seq_fixed_256": (large, MicroBatchConfig(micro_batch_size=256)),
        "4096_seq_dynamic_16384": (large, MicroBatchConfig(micro_batch_size=None, max_tokens=16384)),
    }
    print(json.dumps({name: measure(batch, config) for name, (batch, config) in cases.items()}))


if __name__ == "__main__":
    main()

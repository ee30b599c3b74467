"""``benchmarks/grpo_generation_bound.py``'s arithmetic: the per-step figures it reads from a run's metrics, and
the ratios it asks for. Reads one small file; well under a second."""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def bench() -> Iterator[ModuleType]:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield importlib.import_module("grpo_generation_bound")
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_figures_leave_out_the_first_steps_and_weigh_by_tokens(bench: ModuleType, tmp_path: Path) -> None:
    rows = [
        {"step": 0, "val/accuracy": 0.0},
        {"step": 1, "perf/step_time_s": 99.0, "perf/generating_s": 90.0, "train/response_length": 10.0},
        {"step": 2, "perf/step_time_s": 4.0, "perf/generating_s": 2.0, "train/response_length": 128.0},
        {"step": 3, "perf/step_time_s": 6.0, "perf/generating_s": 2.0, "train/response_length": 126.0},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = bench.figures(tmp_path, samples_per_step=32, skip=1)
    # Steps 2-3: 32 x (128 + 126) = 8128 response tokens in 10 s of steps, 4 s of generating.
    assert got["s_per_step"] == pytest.approx(5.0)
    assert got["tokens_per_s"] == pytest.approx(812.8)
    assert got["generation_tokens_per_s"] == pytest.approx(2032.0)
    assert got["response_length"] == pytest.approx(127.0)
    with pytest.raises(RuntimeError, match="raise --steps above --skip"):
        bench.figures(tmp_path, samples_per_step=32, skip=3)


def test_pairs_compare_overlap_to_sync_and_vllm_to_hf(bench: ModuleType) -> None:
    names = ["hf/sync", "hf/async:2", "vllm/sync", "vllm/async:2", "vllm-server/one_step_off"]
    assert bench._pairs(names) == [
        ("hf/async:2", "hf/sync"),
        ("vllm/sync", "hf/sync"),
        ("vllm/async:2", "vllm/sync"),
        ("vllm/async:2", "hf/async:2"),
    ]


def test_trl_figures_make_a_step_of_a_generation_and_its_optimizer_steps(bench: ModuleType) -> None:
    # 3 generations of 2 optimizer steps each, starting at t=100; generation 0 is left out (skip=1).
    clock = {
        "first_step_start": [100.0],
        "step_ends": [130.0, 140.0, 145.0, 150.0, 154.0, 160.0],
        "generation_s": [25.0, 3.0, 1.0],
        "completion_length": [10.0, 128.0, 126.0],
    }
    got = bench.trl_figures(clock, samples_per_step=32, mini_batches=2, skip=1)
    # Steps 1-2 span 140 -> 150 and 150 -> 160: 10 s each; 32 x (128 + 126) = 8128 tokens in 20 s, 4 s generating.
    assert got["s_per_step"] == pytest.approx(10.0)
    assert got["tokens_per_s"] == pytest.approx(406.4)
    assert got["generation_tokens_per_s"] == pytest.approx(2032.0)
    assert got["generation_s_per_step"] == pytest.approx(2.0)
    assert got["response_length"] == pytest.approx(127.0)
    assert got["measured_steps"] == 2.0
    with pytest.raises(RuntimeError, match="raise --steps above --skip"):
        bench.trl_figures(clock, samples_per_step=32, mini_batches=2, skip=3)


def test_pairs_compare_each_drivetrain_variant_to_each_trl_one(bench: ModuleType) -> None:
    names = ["hf/sync", "vllm/sync", "trl/sync", "trl-vllm/sync"]
    assert bench._pairs(names) == [
        ("hf/sync", "trl/sync"),
        ("hf/sync", "trl-vllm/sync"),
        ("vllm/sync", "trl/sync"),
        ("vllm/sync", "trl-vllm/sync"),
        ("vllm/sync", "hf/sync"),
    ]

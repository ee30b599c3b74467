"""Peak memory of ``drivetrain ckpt merge`` against the bound a streaming merge promises (prints one JSON object).

A ~430 MB float32 Qwen2 model (hidden 512, 32 layers, vocab 8000) is saved as an FSDP-layout DCP step in one
process; a fresh process imports everything, resets its peak-RSS counter (``/proc/self/clear_refs``), merges
the step into 32 MB safetensors shards and reads its peak RSS (``VmHWM``). The growth must stay within one
shard (the writer's pending tensors) plus three times the largest tensor (DCP reads a tensor's bytes, decodes
them, and copies them into the full-size buffer) plus a fixed allowance for allocator slack, which is far below
the model size: the merge never holds the whole model. Exits with status 1 when the bound is exceeded.

Run: ``.venv/bin/python benchmarks/ckpt_merge_memory_benchmark.py [--json-out result.json]``
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from peak_memory import reset_peak_rss, run_in_fresh_process, status_bytes

MODEL: dict[str, Any] = {
    "hidden_size": 512,
    "num_hidden_layers": 32,
    "intermediate_size": 1536,
    "vocab_size": 8000,
}
MAX_SHARD_BYTES = 32 * 1000**2
ALLOWANCE_BYTES = 48 * 1024**2
"""Fixed headroom over the data-proportional terms: DCP read planning, file buffers, malloc slack."""
DCP_READ_COPIES = 3


def write_step(work: Path) -> dict:
    """Build the model, save its weights as a DCP step with a manifest; returns its size facts."""
    import torch
    import torch.distributed.checkpoint as dcp
    from drivetrain_engine_core._checkpoint import write_manifest
    from drivetrain_engine_core.job import Manifest
    from drivetrain_engine_core.testing.models import make_tiny_model_dir
    from transformers import AutoModelForCausalLM

    source = make_tiny_model_dir(work / "source", **MODEL)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    state = model.state_dict()
    step = work / "ckpt" / "global_step_1"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=str(step / "model"))
    manifest = Manifest(
        backend="fsdp", global_step=1, world_size=1, model_type="language_model", model_path=str(source)
    )
    write_manifest(step, manifest)
    sizes = [t.numel() * t.element_size() for t in state.values()]
    return {"model_bytes": sum(sizes), "largest_tensor_bytes": max(sizes), "num_tensors": len(sizes)}


def measure_merge(work: Path, queue: multiprocessing.Queue) -> None:
    """In a fresh process: import everything, note the RSS, merge, report the peak growth."""
    # Imported up front: module code is not part of what a merge allocates per tensor.
    import drivetrain_engine_fsdp.merger  # noqa: F401
    import transformers  # noqa: F401
    from drivetrain_ckpt_tools.merge import MergeOptions, merge_checkpoint
    from drivetrain_engine_core.job import plugins

    plugins()
    reset_peak_rss()
    baseline = status_bytes("VmRSS")
    start = time.perf_counter()
    step = work / "ckpt" / "global_step_1"
    merge_checkpoint(step, work / "merged", MergeOptions(max_shard_bytes=MAX_SHARD_BYTES))
    seconds = time.perf_counter() - start
    queue.put(
        {"baseline_rss_bytes": baseline, "peak_rss_bytes": status_bytes("VmHWM"), "merge_seconds": seconds}
    )


def _write_step_child(work: Path, queue: multiprocessing.Queue) -> None:
    queue.put(write_step(work))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json-out", type=Path, help="Also write the result to this file.")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ckpt-merge-bench-") as tmp:
        work = Path(tmp)
        facts = run_in_fresh_process(_write_step_child, work)
        measured = run_in_fresh_process(measure_merge, work)
        shard_files = sorted(p.name for p in (work / "merged").glob("model-*.safetensors"))
    growth = measured["peak_rss_bytes"] - measured["baseline_rss_bytes"]
    bound = MAX_SHARD_BYTES + DCP_READ_COPIES * facts["largest_tensor_bytes"] + ALLOWANCE_BYTES
    result = {
        "benchmark": "ckpt_merge_memory",
        "model": MODEL,
        **facts,
        "max_shard_bytes": MAX_SHARD_BYTES,
        "num_shards": len(shard_files),
        **measured,
        "merge_growth_bytes": growth,
        "bound_bytes": bound,
        "growth_over_model": round(growth / facts["model_bytes"], 3),
        "passed": growth <= bound,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.json_out:
        args.json_out.write_text(text)
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())

"""One training step of a 0.5B model on one GPU: the engines against bare Hugging Face loops (prints JSON).

Reproduces the table of issue #15 on any CUDA machine. Qwen2.5-0.5B's shape built from a config (fresh weights,
hidden 896, 24 layers, 14/2 heads, intermediate 4864, vocab 151,936, tied embeddings); 64 long-tailed sequences
drawn with ``numpy.random.default_rng(0)`` (prompt ``integers(128, 512, endpoint=True)``, response
``lognormal(ln 512, 1)`` truncated to an int and clipped to ``[16, 4096]``: 86,976 tokens); dynamic micro-batches of
at most 16,384 tokens (core's own split, so every variant sees the same micro-batches); token-mean NLL over the
response tokens; AdamW; bf16 compute with float32 master weights. Variants:

- ``fsdp``: ``FSDPEngine.train_batch`` (one rank, FSDP2, per-sequence attention, chunked hidden-state log-probs).
- ``fsdp_compile``: the same with ``compile_layers`` (each decoder layer ``torch.compile``d; the warm-up steps
  pay the compilation).
- ``fsdp_liger``: ``fsdp`` with ``log_prob_kernel="liger"`` (Liger-Kernel's fused linear cross-entropy);
  ``fsdp_fused``: both, compiled layers and Liger (the engine's fastest settings). Skipped without
  ``liger_kernel`` or on CPU.
- ``fsdp_padded``: the FSDP engine on right-padded rows (``use_remove_padding=False``), 8 sequences per
  micro-batch, against ``bare_padded``.
- ``bare``: a plain transformers model + AdamW over the same micro-batches and the same per-sequence attention
  function, full logits and ``log_softmax``, under ``torch.autocast``.
- ``megatron``: ``MegatronEngine.train_batch``; reported as skipped when megatron-core or mbridge do not import.
- ``fsdp_offload``: the FSDP engine with ``param_offload`` and ``optimizer_offload``: every step loads parameters
  and optimizer state, trains, and offloads them again (``train_mode`` around each step); ``transfers`` gives the
  last load and offload in seconds and bytes (the engine's ``transfer_metrics``).
- ``bare_padded``: the bare loop on right-padded rows, 8 sequences per micro-batch; an out-of-memory error is
  reported (``"oom"``), not raised.
- ``fsdp_infer`` / ``fsdp_infer_fused`` / ``bare_infer``: forward-only per-token log-probs of the same batch.

Per variant: seconds per step (median of ``--steps`` after ``--warmup``), tokens/s, achieved TFLOP/s and MFU from
core's FLOP counter (:mod:`drivetrain_engine_core._throughput`, model FLOPs, attention included) and peak table,
and peak device memory (the largest ``torch.cuda.max_memory_allocated`` of one step, warm-up included, the counter
reset before each: engines reset it at the start of every step too, so a longer window would hold the engine's
last step against the bare loops' whole run, initialisation included), plus the
first step's loss (engine and bare losses should agree to bf16 noise: same seed, same weights).

On a GPU (3-4 minutes on one H100 for the variants of the first measured run; every compiled variant now
compiles afresh, so allow more, or split the run with ``--only``; ``--out`` keeps each variant's result as it
finishes, for a run a time limit may stop)::

    uv run --all-packages --locked python benchmarks/gpu_step_benchmark.py --out results.json

Measured on one H100 80GB (torch 2.11, transformers 5.17, Liger-Kernel 0.8.5): ``results/gpu_step_h100.json``
(and ``results/gpu_step_h100_padded.json``, the run with the padded variants, one commit earlier).

``--device cpu --tiny`` runs every variant on a tiny model and 8 short sequences, to check the code paths
without a GPU (its timings say nothing about a GPU).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from drivetrain_engine_core._data.batch import move_batch
from drivetrain_engine_core._data.micro_batch import split_micro_batches
from drivetrain_engine_core._data.packing import pack_micro_batch, pad_micro_batch
from drivetrain_engine_core._throughput import TransformerShape, peak_tflops
from drivetrain_engine_core.backend import EngineConfig, ModelConfig, OptimizerConfig
from drivetrain_engine_core.job import LOSS_MASK, MicroBatchConfig, init_distributed, make_batch
from drivetrain_engine_core.testing.losses import token_mean_nll
from drivetrain_engine_fsdp.attention import register_varlen_attention
from drivetrain_engine_fsdp.config import FSDPEngineConfig
from drivetrain_engine_fsdp.engine import FSDPEngine
from drivetrain_engine_fsdp.inputs import packed_row_kwargs
from transformers import AutoConfig, AutoModelForCausalLM

SEED = 0
QWEN_0_5B = {
    "hidden_size": 896,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "intermediate_size": 4864,
    "vocab_size": 151_936,
    "max_position_embeddings": 32_768,
    "rope_theta": 1_000_000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}
TINY = {
    **QWEN_0_5B,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 512,
    "max_position_embeddings": 1024,
}


@dataclass(frozen=True)
class Workload:
    """The batch of one run: the model shape, sequence lengths and micro-batching."""

    model: dict[str, Any]
    num_sequences: int
    prompt: tuple[int, int]
    response_median: int
    response_clip: tuple[int, int]
    max_tokens: int
    padded_sequences: int = 8


FULL = Workload(QWEN_0_5B, 64, (128, 512), 512, (16, 4096), 16_384)
TINY_WORKLOAD = Workload(TINY, 8, (8, 32), 32, (4, 128), 256, padded_sequences=4)
OPTIMIZER = OptimizerConfig(lr=1e-5, clip_grad=1.0, weight_decay=0.0)


def draw_lengths(work: Workload) -> tuple[list[int], list[int]]:
    """Prompt and response lengths (the issue's draw: prompts first, then responses, one generator)."""
    rng = np.random.default_rng(SEED)
    prompts = rng.integers(work.prompt[0], work.prompt[1], work.num_sequences, endpoint=True)
    responses = rng.lognormal(math.log(work.response_median), 1.0, work.num_sequences).astype(int)
    return prompts.tolist(), np.clip(responses, *work.response_clip).tolist()


def build_batch(work: Workload):
    """Random token ids; the loss mask covers the response tokens."""
    prompts, responses = draw_lengths(work)
    rng = np.random.default_rng(SEED + 1)
    vocab = work.model["vocab_size"]
    ids = [torch.from_numpy(rng.integers(0, vocab, p + r)) for p, r in zip(prompts, responses, strict=True)]
    masks = [torch.cat([torch.zeros(p), torch.ones(r)]) for p, r in zip(prompts, responses, strict=True)]
    return make_batch(ids, loss_mask=masks)


def write_config(work: Workload, directory: Path) -> Path:
    """A model directory with only ``config.json``: engines build it with ``from_config_only``."""
    AutoConfig.for_model("qwen2", **work.model, dtype="float32").save_pretrained(directory)
    return directory


# ---------------------------------------------------------------------------------------------- the variants


def fsdp_engine(args, model_dir: Path, padded: bool = False, **options: Any) -> FSDPEngine:
    micro_batch = MicroBatchConfig(micro_batch_size=None, max_tokens=args.work.max_tokens)
    if padded:
        micro_batch = MicroBatchConfig(micro_batch_size=args.work.padded_sequences, max_tokens=None)
    return FSDPEngine(
        model_config=ModelConfig(path=str(model_dir), from_config_only=True, use_remove_padding=not padded),
        engine_config=FSDPEngineConfig(
            device=args.device,
            param_dtype=args.dtype,
            micro_batch=micro_batch,
            **options,
        ),
        optimizer_config=OPTIMIZER,
    )


def megatron_engine(args, model_dir: Path) -> Any:
    from drivetrain_engine_megatron import MegatronEngine, MegatronEngineConfig

    return MegatronEngine(
        model_config=ModelConfig(path=str(model_dir), from_config_only=True),
        engine_config=MegatronEngineConfig(
            device=args.device,
            param_dtype=args.dtype,
            micro_batch=MicroBatchConfig(micro_batch_size=None, max_tokens=args.work.max_tokens),
        ),
        optimizer_config=OPTIMIZER,
    )


def engine_train(engine: Any, batch) -> Callable[[], float]:
    engine.initialize()

    def step() -> float:
        with engine.train_mode():
            output = engine.train_batch(batch, token_mean_nll)
        return float(output.loss)

    step.engine = engine  # type: ignore[attr-defined]  # read for its transfer metrics
    return step


def engine_infer(engine: Any, batch) -> Callable[[], float]:
    engine.initialize()

    def step() -> float:
        with engine.eval_mode():
            output = engine.infer_batch(batch, token_mean_nll)
        return float(output.loss)

    return step


class BareLoop:
    """Transformers + AdamW on micro-batches of ``batch``: packed rows (per-sequence attention) or padded rows."""

    def __init__(self, args, model_dir: Path, batch, *, padded: bool) -> None:
        torch.manual_seed(EngineConfig().seed)  # the engines' seed: the same fresh weights
        attention = "sdpa" if padded else register_varlen_attention()
        self.model = AutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(model_dir), dtype=torch.float32, attn_implementation=attention
        ).to(args.device)
        kernel = {"fused": True} if args.device.startswith("cuda") else {"foreach": True}  # as the engine's
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=OPTIMIZER.lr, weight_decay=0.0, **kernel
        )
        self.device, self.dtype, self.padded = args.device, getattr(torch, args.dtype), padded
        limits = MicroBatchConfig(micro_batch_size=args.work.padded_sequences, max_tokens=None)
        if not padded:
            limits = MicroBatchConfig(micro_batch_size=None, max_tokens=args.work.max_tokens)
        self.micro_batches = split_micro_batches(batch, limits).batches
        self.tokens = float(batch[LOSS_MASK].values().sum())

    def _loss_sum(self, micro_batch) -> torch.Tensor:
        """Summed NLL of the loss-mask tokens (``log_probs[i]`` scores token ``i``, docs §7.1)."""
        micro_batch = move_batch(micro_batch, self.device)
        if self.padded:
            rows = pad_micro_batch(micro_batch)
            kwargs = {
                "input_ids": rows.input_ids,
                "position_ids": rows.position_ids,
                "attention_mask": rows.valid.long(),
                "use_cache": False,
            }
            flat_mask = torch.zeros_like(rows.input_ids, dtype=torch.bool)
            flat_mask[rows.valid] = micro_batch[LOSS_MASK].values()
        else:
            kwargs = packed_row_kwargs(pack_micro_batch(micro_batch))
            flat_mask = micro_batch[LOSS_MASK].values().unsqueeze(0)
        ids = kwargs["input_ids"]
        with torch.autocast(self.device, dtype=self.dtype, enabled=self.dtype != torch.float32):
            logits = self.model(**kwargs).logits
        # Position j predicts token j + 1: score the next token where it is masked in (never across sequences:
        # a sequence's first token is a prompt token, so the shifted mask is off at every boundary).
        log_probs = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        picked = log_probs.gather(-1, ids[:, 1:, None]).squeeze(-1)
        return -(picked * flat_mask[:, 1:]).sum()

    def train(self) -> float:
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for micro_batch in self.micro_batches:
            loss = self._loss_sum(micro_batch) / self.tokens
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), OPTIMIZER.clip_grad)
        self.optimizer.step()
        return float(total)

    def infer(self) -> float:
        self.model.eval()
        with torch.no_grad():
            return float(sum(self._loss_sum(mb) for mb in self.micro_batches)) / self.tokens


# ---------------------------------------------------------------------------------------------- measuring


@contextmanager
def fresh_device(device: str) -> Iterator[None]:
    """Free what the previous variant left, compiled graphs included.

    NOTE: torch.compile's cache is per code object, so the decoder layer's graphs (and its recompile budget)
    were shared by every compiled variant of the run; each variant now starts from an empty cache and pays its
    compilation in its warm-up steps.
    """
    gc.collect()
    torch._dynamo.reset()
    if device == "cuda":
        torch.cuda.empty_cache()
    yield
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure(args, step: Callable[[], float], flops: float, tokens: int) -> dict[str, Any]:
    """Median seconds of ``args.steps`` steps after ``args.warmup``, with speed and memory figures."""
    peaks = StepPeaks(args.device)
    first_loss = peaks.run(step)
    for _ in range(args.warmup - 1):
        peaks.run(step)
    times = []
    for _ in range(args.steps):
        sync(args.device)
        start = time.perf_counter()
        peaks.run(step)
        sync(args.device)
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    tflops = flops / seconds / 1e12
    result: dict[str, Any] = {
        "status": "ok",
        "s_per_step": round(seconds, 4),
        "tokens_per_s": round(tokens / seconds, 1),
        "tflops": round(tflops, 3),
        "mfu": round(tflops / args.peak, 4) if args.peak else None,
        "first_loss": first_loss,
        "cpu_s_per_step": None,
    }
    if args.device == "cuda":
        result["peak_gib"] = round(peaks.largest / float(1 << 30), 2)
    return result


class StepPeaks:
    """The largest peak device memory of one step, over the steps :meth:`run` ran (CUDA only)."""

    def __init__(self, device: str) -> None:
        self.device, self.largest = device, 0

    def run(self, step: Callable[[], float]) -> float:
        if self.device != "cuda":
            return step()
        torch.cuda.reset_peak_memory_stats()
        loss = step()
        self.largest = max(self.largest, torch.cuda.max_memory_allocated())
        return loss


def cpu_time(args, step: Callable[[], float]) -> float:
    """Median process CPU time of a step (on a shared CPU machine, less disturbed than wall time)."""
    times = []
    for _ in range(args.steps):
        start = time.process_time()
        step()
        times.append(time.process_time() - start)
    return round(statistics.median(times), 4)


def run_variant(args, name: str, build: Callable[[], Callable[[], float]], flops: float, tokens: int) -> dict:
    with fresh_device(args.device):
        try:
            step = build()
            result = measure(args, step, flops, tokens)
            if args.device == "cpu":
                result["cpu_s_per_step"] = cpu_time(args, step)
            transfers = getattr(getattr(step, "engine", None), "transfer_metrics", None)
            if transfers and transfers["perf/offload_bytes"]:
                result["transfers"] = transfers  # the last step's load and offload: seconds and bytes
        except torch.OutOfMemoryError as e:
            result = {"status": "oom", "error": str(e).splitlines()[0]}
        finally:
            step = None  # type: ignore[assignment]  # drop the model before the next variant
    print(f"# {name}: {result}", flush=True)
    return result


def installed(module: str) -> bool:
    """Whether ``module`` can be imported (``find_spec`` of ``a.b`` raises when ``a`` itself is missing)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def skip_reason(args, name: str) -> str | None:
    """Why variant ``name`` cannot run here, or ``None``."""
    megatron_modules = ("megatron.core", "mbridge", "drivetrain_engine_megatron")
    if name == "megatron" and not all(installed(m) for m in megatron_modules):
        return "megatron-core, mbridge or drivetrain-engine-megatron is not installed"
    if name in ("fsdp_liger", "fsdp_fused", "fsdp_infer_fused") and (
        args.device != "cuda" or not installed("liger_kernel")
    ):
        return "Liger-Kernel runs on CUDA only and must be installed (drivetrain-engine-fsdp[liger])"
    return None


def variants(args, model_dir: Path, batch) -> Iterator[tuple[str, Callable[[], Callable[[], float]], bool]]:
    """``(name, build, backward)`` of each selected variant."""
    yield "fsdp", lambda: engine_train(fsdp_engine(args, model_dir), batch), True
    yield "fsdp_compile", lambda: engine_train(fsdp_engine(args, model_dir, compile_layers=True), batch), True
    liger = {"log_prob_kernel": "liger"}
    yield "fsdp_liger", lambda: engine_train(fsdp_engine(args, model_dir, **liger), batch), True
    fused = {"compile_layers": True, **liger}
    yield "fsdp_fused", lambda: engine_train(fsdp_engine(args, model_dir, **fused), batch), True
    yield "bare", lambda: BareLoop(args, model_dir, batch, padded=False).train, True
    yield "megatron", lambda: engine_train(megatron_engine(args, model_dir), batch), True
    offload = {"param_offload": True, "optimizer_offload": True}
    yield "fsdp_offload", lambda: engine_train(fsdp_engine(args, model_dir, **offload), batch), True
    yield "fsdp_padded", lambda: engine_train(fsdp_engine(args, model_dir, padded=True), batch), True
    yield "bare_padded", lambda: BareLoop(args, model_dir, batch, padded=True).train, True
    yield "fsdp_infer", lambda: engine_infer(fsdp_engine(args, model_dir), batch), False
    yield "fsdp_infer_fused", lambda: engine_infer(fsdp_engine(args, model_dir, **fused), batch), False
    yield "bare_infer", lambda: BareLoop(args, model_dir, batch, padded=False).infer, False


def ratios(results: dict[str, dict]) -> dict[str, float]:
    """Engine over bare (time, memory), and offloaded over resident, where both ran."""
    pairs = {"fsdp_over_bare": ("fsdp", "bare"), "infer_fsdp_over_bare": ("fsdp_infer", "bare_infer")}
    pairs |= {"infer_fused_over_bare": ("fsdp_infer_fused", "bare_infer")}
    pairs |= {"compile_over_fsdp": ("fsdp_compile", "fsdp"), "liger_over_fsdp": ("fsdp_liger", "fsdp")}
    pairs |= {
        "fused_over_bare": ("fsdp_fused", "bare"),
        "padded_fsdp_over_bare": ("fsdp_padded", "bare_padded"),
    }
    pairs |= {"megatron_over_fsdp": ("megatron", "fsdp"), "offload_over_fsdp": ("fsdp_offload", "fsdp")}
    out = {}
    for name, (top, bottom) in pairs.items():
        a, b = results.get(top, {}), results.get(bottom, {})
        if a.get("status") == "ok" and b.get("status") == "ok":
            out[f"{name}_time"] = round(a["s_per_step"] / b["s_per_step"], 3)
            if a.get("cpu_s_per_step") and b.get("cpu_s_per_step"):
                out[f"{name}_cpu_time"] = round(a["cpu_s_per_step"] / b["cpu_s_per_step"], 3)
            if "peak_gib" in a:
                out[f"{name}_peak"] = round(a["peak_gib"] / b["peak_gib"], 3)
    return out


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--tiny", action="store_true", help="tiny model and 8 short sequences (CPU checks)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant (median reported)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (>= 1)")
    parser.add_argument("--dtype", default=None, help="compute dtype (default bfloat16; float32 with --tiny)")
    parser.add_argument("--peak-tflops", type=float, default=None, help="overrides the peak table for MFU")
    parser.add_argument("--only", nargs="*", default=None, help="variant names to run (default: all)")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="also write the report so far to this JSON file after each variant",
    )
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error(
            "--device cuda but no CUDA device is visible; use --device cpu --tiny to check code paths."
        )
    args.warmup = max(args.warmup, 1)
    args.work = TINY_WORKLOAD if args.tiny else FULL
    args.dtype = args.dtype or ("float32" if args.tiny else "bfloat16")
    args.peak = peak_tflops(args.device, args.peak_tflops, args.dtype)
    return args


def main() -> None:
    args = parse_args()
    init_distributed(args.device, 600.0)
    batch = build_batch(args.work)
    lengths = batch["input_ids"].offsets().diff().tolist()
    model_dir = write_config(args.work, Path(tempfile.mkdtemp()) / "model")
    shape = TransformerShape.from_hf_config(AutoConfig.from_pretrained(model_dir))
    assert shape is not None  # a dense Qwen2 config
    results: dict[str, dict] = {}

    def report() -> dict[str, Any]:
        return {
            "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            "cpu_threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "dtype": args.dtype,
            "model": args.work.model,
            "sequences": len(lengths),
            "tokens": sum(lengths),
            "loss_tokens": int(batch[LOSS_MASK].values().sum()),
            "max_tokens_per_micro_batch": args.work.max_tokens,
            "peak_tflops": args.peak,
            "warmup": args.warmup,
            "steps": args.steps,
            "variants": results,
            "ratios": ratios(results),
        }

    for name, build, backward in variants(args, model_dir, batch):
        if args.only and name not in args.only:
            continue
        reason = skip_reason(args, name)
        if reason is not None:
            results[name] = {"status": "skipped", "reason": reason}
            continue
        flops = shape.step_flops(lengths, backward=backward)
        results[name] = run_variant(args, name, build, flops, sum(lengths))
        if args.out is not None:
            write_partial(args.out, report())
    print(json.dumps(report(), indent=2))


def write_partial(path: Path, report: dict[str, Any]) -> None:
    """The report so far, replaced atomically after every variant: a run stopped by a time limit keeps what
    it measured."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(path.suffix + ".tmp")
    partial.write_text(json.dumps(report, indent=2))
    partial.replace(path)


if __name__ == "__main__":
    main()

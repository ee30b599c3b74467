"""drivetrain's ``sft``, ``dpo`` and ``grpo`` against TRL's SFTTrainer, DPOTrainer and GRPOTrainer (issue #36).

Each case runs both trainers on the same start weights, examples, batch sizes, learning rate and sampling
settings, twice (a short and a long run), in subprocesses whose CPU time (user + system, children included)
is read from ``resource.getrusage``. The marginal cost of a step is

    (CPU of the long run - CPU of the short run) / (long steps - short steps)

which cancels start-up, imports, warm starts, the two evaluations and the final save; the same difference of
wall times is reported beside it. Finally both long runs' models are scored by the same plain Hugging Face
code (``trl_worker.score``). Run it alone on the machine for wall times; CPU seconds survive a shared machine
better, but not fully (caches, frequency). A GRPO "step" is drivetrain's: one generation of
``prompts x n`` samples and its ``mini_batches`` optimizer steps (TRL: ``steps_per_generation`` steps).

    /work/trl-venv/bin/python benchmarks/trl_comparison.py --quick --out benchmarks/results/trl_comparison.json

Without ``trl`` importable (``--trl-python``) only drivetrain's rows are measured.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
WORKER = HERE / "trl_worker.py"
SHARED = (
    "trainer.eval_every=0",
    "trainer.save_every=0",
    "trainer.progress_bar=false",
    "trainer.eval_samples=200",
)
CASE_KEYS = ("sft", "dpo", "grpo", "realistic")
"""What ``--only`` selects: a case's first word, ``realistic`` for the realistic SFT case."""


@dataclass(frozen=True)
class Case:
    """One comparison: the drivetrain command and overrides, and the same settings in the TRL worker's terms."""

    name: str
    command: str
    steps: tuple[int, int]
    overrides: tuple[str, ...]
    trl: dict[str, Any]
    trl_variants: dict[str, dict[str, Any]] = field(default_factory=lambda: {"trl": {}})
    start_model: str = "initial_model"  # under drivetrain's run folder: what TRL starts from

    @property
    def key(self) -> str:
        """The case's name in ``--only``: its first word, or ``realistic``."""
        return "realistic" if "realistic" in self.name else self.name.split()[0]


def cases(quick: bool) -> list[Case]:
    """The tiny embedded task (``sft``, ``dpo``, ``grpo`` at their defaults) and the realistic SFT case."""
    scale = (
        (lambda short, long: (short, long))
        if not quick
        else (lambda short, long: (short, short + (long - short) // 4))
    )
    # TRL's SFT padded and padding-free; --quick runs only the padded one, the faster in every run so far.
    sft_variants = {"trl (padded)": {}, **({} if quick else {"trl (padding-free)": {"padding_free": True}})}
    return [
        Case(
            "sft",
            "sft",
            scale(20, 420),
            (),
            {"kind": "sft", "batch": 64, "lr": 3e-3, "warmup": 10},
            sft_variants,
        ),
        Case(
            "dpo",
            "dpo",
            scale(20, 420),
            (),
            {"kind": "dpo", "batch": 32, "lr": 1e-4, "warmup": 0, "beta": 0.5},
            start_model="warm_start/final_model",
        ),
        Case(
            "grpo",
            "grpo",
            scale(4, 84),
            # TRL's side makes 2 optimizer steps per generation (mini_batches below); the embedded job's default
            # is 4 since the model's heads became 32 wide, so drivetrain is held to TRL's 2 here.
            ("algorithm.ppo_mini_batches=2",),
            {
                "kind": "grpo",
                "prompts": 32,
                "n": 8,
                "mini_batches": 2,
                "lr": 2e-4,
                "warmup": 10,
                "beta": 0.001,
                "max_new_tokens": 6,
            },
            start_model="warm_start/final_model",
        ),
        Case(
            "sft realistic (4.3M params, ~8k tokens/step)",
            "sft",
            # --quick: 1 vs 3 steps (the realistic runs were most of the full run's time: TRL's take 15-25 CPU-s
            # a step); two marginal steps against start-ups of 30-90 s, so read its quick figure as rough.
            (1, 3) if quick else (3, 23),
            (
                "optimizer.lr=3e-4",
                "engine.micro_batch.max_tokens=8192",
                "trainer.batch_size=64",
                "data.max_length=512",
                "trainer.eval_samples=20",
            ),
            {"kind": "sft", "batch": 64, "lr": 3e-4, "warmup": 0},
            sft_variants,
        ),
    ]


def realistic_assets(root: Path) -> tuple[str, ...]:
    """A 4-layer, 256-wide Qwen2 (about 4.3 M parameters) with the arithmetic tokenizer, and long sums
    (``"12+7+...="``, 60 to 400 tokens, long-tailed) of which 64 make about 8k tokens (measured: 3.6-4.2k per 32): the overrides that point
    ``drivetrain sft`` at them (warm-up 0: the schedule is a user model's)."""
    import random

    import torch
    from drivetrain_roles.jobs.default_assets import build_arithmetic_tokenizer
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = build_arithmetic_tokenizer()
    config = AutoConfig.for_model(
        "qwen2",
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model_dir = root / "realistic_model"
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    rng = random.Random(0)

    def row() -> str:
        terms = [rng.randint(1, 99) for _ in range(min(130, int(rng.paretovariate(1.5) * 20)))]
        return json.dumps({"prompt": "+".join(map(str, terms)) + "=", "response": str(sum(terms))})

    (root / "data").mkdir(parents=True, exist_ok=True)
    for split, count in (("train", 2000), ("val", 20)):
        (root / "data" / f"{split}.jsonl").write_text("\n".join(row() for _ in range(count)) + "\n")
    return (
        f"model.path={model_dir}",
        f"data.train_files=[{root / 'data' / 'train.jsonl'}]",
        f"data.val_files=[{root / 'data' / 'val.jsonl'}]",
        "optimizer.warmup_steps=0",
    )


def measured(argv: list[str], env: dict[str, str] | None = None) -> dict[str, float]:
    """Run ``argv`` to completion; its CPU seconds (user + system, its children included) and wall seconds."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run(argv, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode:
        raise RuntimeError(f"{' '.join(argv[:4])} ... failed ({done.returncode}):\n{done.stderr[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"cpu_s": cpu, "wall_s": wall}


def marginal(short: dict[str, float], long: dict[str, float], steps: tuple[int, int]) -> dict[str, float]:
    """Per-step CPU and wall seconds between a short and a long run."""
    extra = steps[1] - steps[0]
    return {
        "cpu_s_per_step": (long["cpu_s"] - short["cpu_s"]) / extra,
        "wall_s_per_step": (long["wall_s"] - short["wall_s"]) / extra,
        "runs": {"short": short, "long": long},
    }


def run_case(
    case: Case, work: Path, trl_python: str | None, extra: tuple[str, ...], assets: Path | None = None
) -> dict[str, Any]:
    """Both trainers' short and long runs of ``case`` and the held-out scores of the long runs' models; a case
    with its own ``assets`` (model and ``data/``) starts TRL there, else from drivetrain's short run folder."""
    folder = work / (case.name.split()[0] + ("_realistic" if case.key == "realistic" else ""))
    runs: dict[int, Path] = {}
    times = {}
    for steps in case.steps:
        runs[steps] = folder / f"drivetrain_{steps}"
        argv = [
            sys.executable,
            "-m",
            "drivetrain_engine_core",
            case.command,
            "--overwrite",
            "--output-dir",
            str(runs[steps]),
            f"trainer.total_steps={steps}",
            *SHARED,
            *case.overrides,
            *extra,
        ]
        times[steps] = measured(argv)
    rows: dict[str, Any] = {"drivetrain": marginal(times[case.steps[0]], times[case.steps[1]], case.steps)}
    models = {"drivetrain": str(runs[case.steps[1]] / "final_model")}
    data_run = assets or runs[case.steps[0]]
    start = assets / "realistic_model" if assets else runs[case.steps[0]] / case.start_model
    for variant, options in case.trl_variants.items() if trl_python else ():
        trl_times = {}
        for steps in case.steps:
            out = folder / f"{variant.replace(' ', '_')}_{steps}"
            spec = {
                **case.trl,
                **options,
                "steps": steps,
                "warmup": _warmup(case, steps),
                "run": str(data_run),
                "model": str(start),
                "out": str(out),
            }
            trl_times[steps] = measured([trl_python, str(WORKER), "train", json.dumps(spec)])
            models[variant] = str(out)
        rows[variant] = marginal(trl_times[case.steps[0]], trl_times[case.steps[1]], case.steps)
    scorer = trl_python or sys.executable
    spec = {
        "kind": case.trl["kind"],
        "run": str(data_run),
        "models": models,
        "reference": str(start),
        "max_new_tokens": case.trl.get("max_new_tokens", 8),
        "limit": 200,
    }
    done = subprocess.run(
        [scorer, str(WORKER), "score", json.dumps(spec)], capture_output=True, text=True, check=True
    )
    for name, values in json.loads(done.stdout.strip().splitlines()[-1]).items():
        rows[name]["held_out"] = values
    best_trl = min((v["cpu_s_per_step"] for k, v in rows.items() if k != "drivetrain"), default=None)
    return {
        "steps": list(case.steps),
        "rows": rows,
        "drivetrain_over_fastest_trl": rows["drivetrain"]["cpu_s_per_step"] / best_trl if best_trl else None,
    }


def _warmup(case: Case, steps: int) -> int:
    """The warm-up steps drivetrain's run of ``steps`` takes: SFT's is a tenth of the run, at most 10."""
    return min(case.trl["warmup"], steps // 10) if case.trl["kind"] == "sft" else case.trl["warmup"]


def table(results: dict[str, Any]) -> str:
    """A Markdown table of the results."""
    lines = ["| case | trainer | CPU-s/step | wall s/step | held-out |", "| --- | --- | --- | --- | --- |"]
    for case, result in results["cases"].items():
        for trainer, row in result["rows"].items():
            held = ", ".join(f"{k.split('/')[-1]} {v:.3f}" for k, v in row.get("held_out", {}).items())
            lines.append(
                f"| {case} | {trainer} | {row['cpu_s_per_step']:.4f} | {row['wall_s_per_step']:.4f} | {held} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="long runs a quarter as long, the realistic case 1 vs 3 steps, TRL's SFT padded only (~6 min)",
    )
    parser.add_argument(
        "--only",
        nargs="*",
        default=None,
        choices=CASE_KEYS,
        help="the cases to run (default: all); e.g. --only grpo re-measures the GRPO pair alone",
    )
    parser.add_argument(
        "--trl-python", default=None, help="a Python with trl (default: this one if it has trl)"
    )
    parser.add_argument("--no-trl", action="store_true", help="measure drivetrain only")
    parser.add_argument("--work", default="/tmp/drivetrain-trl-comparison", help="run folders")
    parser.add_argument("--out", default=None, help="write the JSON report here (rewritten after every case)")
    parser.add_argument(
        "--tiny", action="store_true", help="dry run: 1- and 2-step runs, no meaningful numbers"
    )
    args = parser.parse_args()
    trl_python = None if args.no_trl else args.trl_python or (sys.executable if _has_trl() else None)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    started = _children_cpu()
    results: dict[str, Any] = {
        "quick": args.quick,
        "trl_python": trl_python,
        "cases": {},
        "machine": _machine(),
    }
    for case in cases(args.quick):
        key = case.key
        if args.only and key not in args.only:
            continue
        if args.tiny:
            case = Case(**{**case.__dict__, "steps": (1, 2)})
        assets = work / "realistic_assets" if key == "realistic" else None
        extra = realistic_assets(assets) if assets else ()
        results["cases"][case.name] = run_case(case, work, trl_python, extra, assets)
        # With one process at a time at one thread each, this is about the wall time the run takes alone.
        results["children_cpu_s"] = _children_cpu() - started
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
        print(json.dumps({case.name: results["cases"][case.name]}), flush=True)
    print(table(results))


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _has_trl() -> bool:
    try:
        import trl  # noqa: F401
    except ImportError:
        return False
    return True


def _machine() -> dict[str, Any]:
    import platform

    import torch

    return {
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "load_avg_at_start": os.getloadavg(),
        "python": platform.python_version(),
    }


if __name__ == "__main__":
    main()

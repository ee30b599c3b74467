"""drivetrain's ``sft``, ``dpo`` and ``grpo`` against TRL's SFTTrainer, DPOTrainer and GRPOTrainer (issues #36, #49).

Each case runs both trainers on the same start weights, examples, batch sizes, learning rate and sampling
settings, as a short and a long run, in subprocesses whose CPU time (user + system, children included) is read
from ``resource.getrusage``. The marginal cost of a step is

    (CPU of the long run - CPU of the short run) / (long steps - short steps)

which cancels start-up, imports, warm starts, the two evaluations and the final save; the same difference of
wall times is reported beside it. Each side's pair is one variant of ``rounds.py``: ``--rounds`` rounds
(default 3), the order rotated every round, each run's load recorded by the guard; the report gives each
side's median with its range and the ratio drivetrain / TRL taken per round, its median and range. Round ``r``
trains both sides at seed ``r`` from the same start (an untimed drivetrain run of that seed made before the
rounds), so the long runs' models, scored by the same plain Hugging Face code (``trl_worker.score``), give each
quality figure over ``--rounds`` seeds. Both sides must import the same torch build (refused otherwise). A GRPO
"step" is drivetrain's: one generation of ``prompts x n`` samples and its ``mini_batches`` optimizer steps
(TRL: ``steps_per_generation`` steps).

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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import rounds
from trl_cases import CASE_KEYS, SHARED, Case, cases, realistic_assets

HERE = Path(__file__).resolve().parent
WORKER = HERE / "trl_worker.py"


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
    """Per-step CPU and wall seconds between a short and a long run (and the two runs' own figures)."""
    extra = steps[1] - steps[0]
    return {
        "cpu_s_per_step": (long["cpu_s"] - short["cpu_s"]) / extra,
        "wall_s_per_step": (long["wall_s"] - short["wall_s"]) / extra,
        "short_cpu_s": short["cpu_s"],
        "long_cpu_s": long["cpu_s"],
    }


@dataclass(frozen=True)
class Plan:
    """Where one case's runs go and what they start from: round ``r`` trains with seed ``r``; TRL's runs of a
    round read the data and start weights of an untimed drivetrain run of that seed (``assets/seed<r>``), or
    the realistic case's ``assets`` folder, so that neither side's timed runs wait on the other's."""

    case: Case
    folder: Path
    extra: tuple[str, ...]
    assets: Path | None

    def drivetrain_argv(self, steps: int, seed: int, out: Path) -> list[str]:
        """``drivetrain <command>`` for ``steps`` steps at ``seed``, written to ``out``."""
        return [
            sys.executable,
            "-m",
            "drivetrain_engine_core",
            self.case.command,
            "--overwrite",
            "--output-dir",
            str(out),
            f"trainer.total_steps={steps}",
            f"trainer.seed={seed}",
            *SHARED,
            *self.case.overrides,
            *self.extra,
        ]

    def data_run(self, seed: int) -> Path:
        """The folder whose ``data/`` and start model TRL's runs of ``seed`` read (made on first use)."""
        if self.assets:
            return self.assets
        run = self.folder / "assets" / f"seed{seed}"
        if not (run / self.case.start_model).exists():
            measured(self.drivetrain_argv(self.case.steps[0], seed, run))
        return run

    def start(self, seed: int) -> Path:
        """The weights both sides start from at ``seed``."""
        return self.assets / "realistic_model" if self.assets else self.data_run(seed) / self.case.start_model

    def out(self, variant: str, seed: int, steps: int) -> Path:
        return self.folder / f"{variant.replace(' ', '_')}_seed{seed}_{steps}"


def variants(plan: Plan, trl_python: str | None) -> list[rounds.Variant]:
    """drivetrain's and each TRL variant's short-and-long pair as a rounds variant (its figures: the marginal
    CPU and wall seconds per step of that round)."""
    case = plan.case

    def drivetrain(seed: int) -> dict[str, float]:
        runs = [measured(plan.drivetrain_argv(s, seed, plan.out("drivetrain", seed, s))) for s in case.steps]
        return marginal(*runs, case.steps)

    def trl(name: str, options: dict[str, Any]) -> rounds.Variant:
        def run(seed: int) -> dict[str, float]:
            data_run, start = str(plan.data_run(seed)), str(plan.start(seed))
            times = []
            for steps in case.steps:
                spec = {**case.trl, **options, "steps": steps, "warmup": _warmup(case, steps), "seed": seed}
                spec |= {"run": data_run, "model": start, "out": str(plan.out(name, seed, steps))}
                times.append(measured([str(trl_python), str(WORKER), "train", json.dumps(spec)]))
            return marginal(*times, case.steps)

        return rounds.Variant(name, run)

    trls = [trl(name, options) for name, options in case.trl_variants.items()] if trl_python else []
    return [rounds.Variant("drivetrain", drivetrain), *trls]


def prepare(plan: Plan, seeds: int) -> None:
    """Make each seed's untimed assets before the rounds (so that no timed run includes their making)."""
    for seed in range(seeds):
        plan.start(seed)


def quality(plan: Plan, names: list[str], seeds: int, scorer: str) -> dict[str, Any]:
    """The held-out figures of every long run, per seed, scored by the same plain Hugging Face code, and each
    variant's :func:`rounds.spread` of each figure over the seeds."""
    case, per_seed = plan.case, []
    for seed in range(seeds):
        spec = {
            "kind": case.trl["kind"],
            "run": str(plan.data_run(seed)),
            "models": {n: str(_model(plan.out(n, seed, case.steps[1]), n)) for n in names},
            "reference": str(plan.start(seed)),
            "max_new_tokens": case.trl.get("max_new_tokens", 8),
            "limit": 200,
        }
        done = subprocess.run(
            [scorer, str(WORKER), "score", json.dumps(spec)], capture_output=True, text=True, check=True
        )
        per_seed.append(json.loads(done.stdout.strip().splitlines()[-1]))
    spreads = {n: {k: rounds.spread([s[n][k] for s in per_seed]) for k in per_seed[0][n]} for n in names}
    return {"per_seed": per_seed, "spread": spreads}


def _model(out: Path, name: str) -> Path:
    """A long run's model folder: drivetrain's ``final_model``, TRL's output folder itself."""
    return out / "final_model" if name == "drivetrain" else out


def run_case(
    plan: Plan,
    trl_python: str | None,
    options: argparse.Namespace,
    result: dict[str, Any],
    report: Callable[[], None],
) -> None:
    """The case in ``options.rounds`` rotated rounds (seed ``r`` in round ``r``), into ``result`` as the runs
    end (``report`` writes it out): every run, each side's spread, the per-round ratios of drivetrain to each
    TRL variant, and the quality figures over the rounds' seeds."""
    prepare(plan, options.rounds)
    result |= {"steps": list(plan.case.steps), "warmup_runs": options.warmup_runs, "rounds": []}
    guard = rounds.guard_from(options)

    def on_run(record: dict[str, Any]) -> None:
        result["rounds"].append(record)
        report()

    records = rounds.run_rounds(
        variants(plan, trl_python), options.rounds, guard, on_run, warmup_runs=options.warmup_runs
    )
    result["summary"] = rounds.summary(records)
    others = [name for name in result["summary"] if name != "drivetrain"]
    ratios = {n: rounds.ratio(records, "drivetrain", n, "cpu_s_per_step") for n in others}
    result["drivetrain_over_trl"] = ratios
    if others:  # the headline: against the TRL variant with the lowest median CPU-s/step
        fastest = min(others, key=lambda n: result["summary"][n]["cpu_s_per_step"]["median"])
        result["drivetrain_over_fastest_trl"] = {"trl_variant": fastest, **ratios[fastest]}
    result["quality"] = quality(plan, list(result["summary"]), options.rounds, trl_python or sys.executable)


def _warmup(case: Case, steps: int) -> int:
    """The warm-up steps drivetrain's run of ``steps`` takes: SFT's is a tenth of the run, at most 10."""
    return min(case.trl["warmup"], steps // 10) if case.trl["kind"] == "sft" else case.trl["warmup"]


def _range(s: dict[str, Any], digits: int = 4) -> str:
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"


def _held(spreads: dict[str, Any]) -> str:
    return ", ".join(f"{key.split('/')[-1]} {_range(value, 3)}" for key, value in spreads.items())


def table(results: dict[str, Any]) -> str:
    """A Markdown table of the medians with their ranges over rounds (quality: over seeds)."""
    lines = [
        "| case | trainer | CPU-s/step | wall s/step | drivetrain / this | held-out (over seeds) | flagged rounds |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for case, result in results["cases"].items():
        for trainer, row in result.get("summary", {}).items():
            ratio = result["drivetrain_over_trl"].get(trainer)
            held = result.get("quality", {}).get("spread", {}).get(trainer, {})
            lines.append(
                f"| {case} | {trainer} | {_range(row['cpu_s_per_step'])} | {_range(row['wall_s_per_step'])} | "
                f"{_range(ratio, 2) if ratio else ''} | "
                f"{_held(held)} | "
                f"{row['flagged_rounds'] or ''} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="long runs a quarter as long, the realistic case 1 vs 3 steps, TRL's SFT padded only",
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
    parser.add_argument("--out", default=None, help="write the JSON report here (rewritten after every run)")
    parser.add_argument(
        "--tiny", action="store_true", help="dry run: 1- and 2-step runs, no meaningful numbers"
    )
    rounds.add_arguments(parser)  # --rounds: round r trains at seed r
    args = parser.parse_args()
    trl_python = None if args.no_trl else args.trl_python or (sys.executable if _has_trl() else None)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    builds = {"drivetrain": rounds.torch_build(sys.executable)}
    if trl_python:
        builds["trl"] = rounds.torch_build(trl_python)
    rounds.same_torch(builds)
    started = _children_cpu()
    results: dict[str, Any] = {
        "quick": args.quick,
        "rounds": args.rounds,
        "trl_python": trl_python,
        "torch": builds,
        "cases": {},
        "machine": _machine(),
    }

    def report() -> None:
        # One process at a time at one thread: about the wall time the run takes alone.
        results["children_cpu_s"] = _children_cpu() - started
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=2) + "\n")

    for case in cases(args.quick):
        if args.only and case.key not in args.only:
            continue
        if args.tiny:
            case = Case(**{**case.__dict__, "steps": (1, 2)})
        assets = work / "realistic_assets" if case.key == "realistic" else None
        folder = work / (case.name.split()[0] + ("_realistic" if assets else ""))
        plan = Plan(case, folder, realistic_assets(assets) if assets else (), assets)
        results["cases"][case.name] = result = {}
        run_case(plan, trl_python, args, result, report)
        report()
        print(json.dumps({case.name: result["summary"]}), flush=True)
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

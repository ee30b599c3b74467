"""GRPO where generation is the cost: tokens/s and s/step by rollout and ``trainer.mode`` (issue #49, prints JSON).

The job: ``rollout_vllm_benchmark.py``'s ``small`` model (hidden 512, 8 layers, 32k vocabulary; built from its
config with random weights and saved locally, no download), ``--prompts`` prompts of about 30 tokens per step,
``--n`` 8 responses each of ``--new-tokens`` tokens (128 by default, 256 at the long end), a graded checksum
reward (``grpo_generation_reward.py``: the loop is measured, not learning), no held-out evaluation. Each variant
is one ``drivetrain grpo`` run of ``--steps`` steps in a subprocess, for each rollout (``hf``, ``vllm``
colocated, ``vllm-server`` in its own process) and mode (``sync``, ``one_step_off``, ``async:<staleness>``), run
in ``--rounds`` rotated rounds by ``rounds.py`` under its load guard. The same job in TRL's GRPOTrainer
(``trl_worker.py``, run by ``--trl-python``) is two more rollouts: ``trl`` (``model.generate``) and ``trl-vllm``
(vLLM colocated, TRL's ``vllm_mode="colocate"``), ``sync`` only (TRL's trainer generates between its steps);
both sides must import the same torch build (refused otherwise), and both share :data:`UPDATE`'s settings.

Figures per run, from the run's ``metrics.jsonl`` after its first ``--skip`` steps (vLLM's warm-up, the first
hand-off): ``s_per_step`` (mean step time), ``tokens_per_s`` (response tokens per second of the loop),
``generation_tokens_per_s`` (response tokens per second of generating), ``response_length`` (mean tokens per
response). TRL's are read from the worker's clock (a step: a generation and its ``mini_batches`` optimizer
steps; generating includes, with vLLM, TRL's weight sync before it). Response lengths are not forced:
drivetrain has no minimum-length or ignore-EOS setting, and the random-weight model samples its end token
about once in 32k tokens, so responses run to ``--new-tokens`` but for a few per step; ``response_length``
says how close.

Placement: ``vllm-server``'s server is pinned to ``--rollout-cpus`` and its trainer to ``--trainer-cpus``
(``taskset``; the server is started through a wrapper named by ``DRIVETRAIN_VLLM_PYTHON``, which also passes this
process's ``PYTHONPATH`` on). ``hf`` and ``vllm`` run in the trainer's process (a thread generates ahead in the
overlapped modes), which per-thread pinning cannot reach: they use every core. Each run records its placement.

    .venv-vllm/bin/python benchmarks/grpo_generation_bound.py --out benchmarks/results/grpo_generation_bound_cpu.json
    .venv-vllm/bin/python benchmarks/grpo_generation_bound.py --rollouts hf,vllm,trl,trl-vllm --modes sync \
        --trl-python /work/trl-vllm-venv/bin/python --out benchmarks/results/grpo_generation_bound_trl_cpu.json

``--rollouts hf`` runs without vLLM; ``--tiny`` (the tiny model, 8 tokens, 2 steps) checks the script only.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import sys
from pathlib import Path
from typing import Any

import rounds
from grpo_async_benchmark import mode_overrides
from rollout_vllm_benchmark import MODELS

HERE = Path(__file__).resolve().parent
REWARD = HERE / "grpo_generation_reward.py"
WORKER = HERE / "trl_worker.py"
ROLLOUTS = ("hf", "vllm", "vllm-server")
TRL_ROLLOUTS = {"trl": False, "trl-vllm": True}
"""TRL's GRPOTrainer as a rollout name, and whether it generates with vLLM colocated."""
UPDATE = {"mini_batches": 4, "lr": 1e-6, "beta": 0.001}
"""The update both trainers make of a step's samples (drivetrain's defaults, written out so that TRL's side
reads the same values): optimizer steps per generation, learning rate (constant), k3 KL coefficient."""


def make_assets(root: Path, model: str, rows: int = 512) -> tuple[Path, Path]:
    """The model (random weights, saved with the tiny tokenizer) and a training file of sums of 8 terms."""
    from drivetrain_engine_core.testing import make_tiny_model_dir

    model_dir = root / model
    if not model_dir.exists():
        make_tiny_model_dir(model_dir, arch="qwen2", **MODELS[model])
    rng, data = random.Random(0), root / "data" / "train.jsonl"
    data.parent.mkdir(parents=True, exist_ok=True)
    terms = [[rng.randint(10, 99) for _ in range(8)] for _ in range(rows)]
    data.write_text(
        "".join(
            json.dumps({"prompt": "+".join(map(str, t)) + "=", "response": str(sum(t))}) + "\n" for t in terms
        )
    )
    return model_dir, data


def job_overrides(
    args: argparse.Namespace, model_dir: Path, data: Path, rollout: str, mode: str
) -> list[str]:
    """``drivetrain grpo``'s overrides for one variant."""
    return [
        f"model.path={model_dir}",
        f"data.train_files=[{data}]",
        f"rollout.name={rollout}",
        f"rollout.n={args.n}",
        f"rollout.max_new_tokens={args.new_tokens}",
        f"trainer.prompts_per_step={args.prompts}",
        f"trainer.total_steps={args.steps}",
        f"algorithm.reward_function={REWARD}:checksum_reward",
        f"algorithm.ppo_mini_batches={UPDATE['mini_batches']}",
        f"algorithm.kl_loss_coef={UPDATE['beta']}",
        f"optimizer.lr={UPDATE['lr']}",
        "optimizer.lr_schedule=constant",
        "trainer.eval_samples=0",
        "trainer.eval_every=0",
        "trainer.save_every=0",
        "trainer.progress_bar=false",
        *mode_overrides(mode),
    ]


def cpu_split(trainer: str | None, rollout: str | None) -> tuple[str, str]:
    """The trainer's and the server's cores (``taskset -c`` lists): as given, else this process's cores halved."""
    cores = sorted(os.sched_getaffinity(0))
    half = max(1, len(cores) // 2)
    default_trainer = ",".join(map(str, cores[:half]))
    default_rollout = ",".join(map(str, cores[half:] or cores))
    return trainer or default_trainer, rollout or default_rollout


def server_wrapper(root: Path, python: str, cpus: str) -> Path:
    """A script that runs the server's Python pinned to ``cpus``, with this process's ``PYTHONPATH``."""
    wrapper = root / "vllm-server-python"
    path = os.environ.get("PYTHONPATH", "")
    exports = f"export PYTHONPATH={path}\n" if path else ""
    wrapper.write_text(f'#!/bin/sh\n{exports}exec taskset -c {cpus} {python} "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


def placement(args: argparse.Namespace, rollout: str, root: Path) -> tuple[list[str], dict[str, str], str]:
    """The trainer's command prefix, its environment and the placement in words."""
    env = dict(os.environ)
    if rollout != "vllm-server":
        if rollout in TRL_ROLLOUTS:
            who = "TRL's trainer" + (" and colocated vLLM" if TRL_ROLLOUTS[rollout] else "")
        else:
            who = f"trainer and {rollout} rollout"
        return [], env, f"{who} in one process on cores {sorted(os.sched_getaffinity(0))}"
    trainer, server = cpu_split(args.trainer_cpus, args.rollout_cpus)
    env["DRIVETRAIN_VLLM_PYTHON"] = str(server_wrapper(root, args.server_python, server))
    return ["taskset", "-c", trainer], env, f"trainer on cores {trainer}, vllm-server on cores {server}"


def figures(run: Path, samples_per_step: int, skip: int) -> dict[str, float]:
    """A run's per-step figures after its first ``skip`` steps, from its ``metrics.jsonl``."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "perf/step_time_s" in r][skip:]
    if not steps:
        raise RuntimeError(f"{run}: no training step after the first {skip}; raise --steps above --skip")
    return step_figures(
        [r["perf/step_time_s"] for r in steps],
        [r["perf/generating_s"] for r in steps],
        [r["train/response_length"] for r in steps],
        samples_per_step,
    )


def step_figures(
    seconds: list[float], generating: list[float], lengths: list[float], samples_per_step: int
) -> dict[str, float]:
    """The figures of the measured steps from their seconds, seconds generating and mean response lengths."""
    tokens = sum(lengths) * samples_per_step
    return {
        "s_per_step": statistics.fmean(seconds),
        "tokens_per_s": tokens / sum(seconds),
        "generation_tokens_per_s": tokens / sum(generating),
        "generation_s_per_step": statistics.fmean(generating),
        "response_length": statistics.fmean(lengths),
        "measured_steps": float(len(seconds)),
    }


def trl_figures(
    clock: dict[str, list[float]], samples_per_step: int, mini_batches: int, skip: int
) -> dict[str, float]:
    """The figures of :func:`figures` from a TRL run's clock (``trl_worker._StepClock``): a step is one
    generation and its ``mini_batches`` optimizer steps, from the end of the step before (the first: from the
    first optimizer step's start)."""
    ends = [*clock["first_step_start"], *clock["step_ends"][mini_batches - 1 :: mini_batches]]
    seconds = [b - a for a, b in itertools.pairwise(ends)][skip:]
    if not seconds:
        raise RuntimeError(f"no TRL step after the first {skip}; raise --steps above --skip")
    measured = slice(skip, skip + len(seconds))
    return step_figures(
        seconds, clock["generation_s"][measured], clock["completion_length"][measured], samples_per_step
    )


def trl_variant(
    args: argparse.Namespace, model_dir: Path, rollout: str, places: dict[str, str]
) -> rounds.Variant:
    """TRL's GRPOTrainer on the same job as a rounds variant: a ``trl_worker.py train`` run per round, its clock
    read back."""
    name = f"{rollout}/sync"
    _, env, places[name] = placement(args, rollout, args.work)
    samples = args.prompts * args.n

    def run(round_index: int) -> dict[str, float]:
        out = args.work / "runs" / f"{rollout}_r{round_index}"
        out.mkdir(parents=True, exist_ok=True)
        spec = {
            "kind": "grpo",
            **UPDATE,
            "warmup": 0,
            "prompts": args.prompts,
            "n": args.n,
            "max_new_tokens": args.new_tokens,
            "steps": args.steps,
            "reward": "checksum",
            "vllm": TRL_ROLLOUTS[rollout],
            "run": str(args.work),
            "model": str(model_dir),
            "out": str(out),
            "timings": str(out / "clock.json"),
        }
        rounds.command([args.trl_python, str(WORKER), "train", json.dumps(spec)], env)(round_index)
        clock = json.loads((out / "clock.json").read_text())
        return trl_figures(clock, samples, UPDATE["mini_batches"], args.skip)

    return rounds.Variant(name, run)


def variant(
    args: argparse.Namespace, assets: tuple[Path, Path], rollout: str, mode: str, places: dict[str, str]
) -> rounds.Variant:
    """One rollout and mode as a rounds variant: a ``drivetrain grpo`` run per round (TRL's rollouts: a TRL
    run, ``sync`` only), read back."""
    (model_dir, data), root = assets, args.work
    if rollout in TRL_ROLLOUTS:
        return trl_variant(args, model_dir, rollout, places)
    name = f"{rollout}/{mode}"
    prefix, env, places[name] = placement(args, rollout, root)

    def run(round_index: int) -> dict[str, float]:
        out = root / "runs" / f"{name.replace('/', '_').replace(':', '-')}_r{round_index}"
        argv = [
            *prefix,
            args.python,
            "-m",
            "drivetrain_engine_core",
            "grpo",
            "--overwrite",
            "--output-dir",
            str(out),
        ]
        rounds.command([*argv, *job_overrides(args, model_dir, data, rollout, mode)], env)(round_index)
        return figures(out, args.prompts * args.n, args.skip)

    return rounds.Variant(name, run)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rollouts",
        default=",".join(ROLLOUTS),
        help="comma-separated: hf, vllm, vllm-server, and TRL's trl, trl-vllm (these need --trl-python)",
    )
    parser.add_argument(
        "--modes", default="sync,one_step_off,async:2", help="comma-separated trainer.mode values"
    )
    parser.add_argument("--steps", type=int, default=4, help="GRPO steps per run (default 4)")
    parser.add_argument("--skip", type=int, default=1, help="first steps left out of the figures (default 1)")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step (default 4)")
    parser.add_argument("--n", type=int, default=8, help="responses per prompt (default 8)")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens per response (default 128)")
    parser.add_argument("--python", default=sys.executable, help="the trainer's Python (default: this one)")
    parser.add_argument(
        "--server-python", default=None, help="vllm-server's Python ($DRIVETRAIN_VLLM_PYTHON)"
    )
    parser.add_argument(
        "--trl-python", default=None, help="a Python with trl and the trainer's torch (the trl rollouts)"
    )
    parser.add_argument(
        "--trainer-cpus", default=None, help="vllm-server's trainer cores (default: first half)"
    )
    parser.add_argument(
        "--rollout-cpus", default=None, help="vllm-server's server cores (default: second half)"
    )
    parser.add_argument("--work", type=Path, default=Path("/tmp/drivetrain-grpo-generation-bound"))
    parser.add_argument("--out", type=Path, default=None, help="write the JSON report here after every run")
    parser.add_argument("--tiny", action="store_true", help="dry run: the tiny model, 8 tokens, 2 steps")
    rounds.add_arguments(parser)
    args = parser.parse_args(argv)
    args.model = "small"
    if args.tiny:
        args.model, args.new_tokens, args.steps, args.prompts, args.n = "tiny", 8, 2, 2, 4
    args.server_python = args.server_python or os.environ.get("DRIVETRAIN_VLLM_PYTHON") or args.python
    unknown = set(args.rollouts.split(",")) - {*ROLLOUTS, *TRL_ROLLOUTS}
    if unknown:
        parser.error(f"--rollouts: {sorted(unknown)} unknown; choose from {[*ROLLOUTS, *TRL_ROLLOUTS]}")
    if set(args.rollouts.split(",")) & set(TRL_ROLLOUTS) and not args.trl_python:
        parser.error("--rollouts trl/trl-vllm need --trl-python: a Python with trl and the trainer's torch")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    places: dict[str, str] = {}
    rollouts, modes = args.rollouts.split(","), args.modes.split(",")
    assets = make_assets(args.work, args.model)
    runs = [(r, m) for r in rollouts for m in modes if r not in TRL_ROLLOUTS or m == "sync"]
    variants = [variant(args, assets, r, m, places) for r, m in runs]
    builds = {"trainer": rounds.torch_build(args.python)}
    if "vllm-server" in rollouts:
        builds["server"] = rounds.torch_build(args.server_python)
    if set(rollouts) & set(TRL_ROLLOUTS):
        builds["trl"] = rounds.torch_build(args.trl_python)
        rounds.same_torch({"trainer": builds["trainer"], "trl": builds["trl"]})
    report: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "torch": builds}
    report |= {"placement": places, "rounds": []}

    def on_run(record: dict[str, Any]) -> None:
        report["rounds"].append(record)
        print(json.dumps(record), file=sys.stderr, flush=True)
        if args.out:
            args.out.write_text(json.dumps(report, indent=1) + "\n")

    report["warmup_runs"] = args.warmup_runs
    records = rounds.run_rounds(
        variants, args.rounds, rounds.guard_from(args), on_run, warmup_runs=args.warmup_runs
    )
    report["summary"] = rounds.summary(records)
    names = [v.name for v in variants]
    report["ratios"] = {f"{a} / {b}": rounds.ratio(records, a, b, "s_per_step") for a, b in _pairs(names)}
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({"summary": report["summary"], "ratios": report["ratios"]}, indent=1))
    return 0


def _pairs(names: list[str]) -> list[tuple[str, str]]:
    """The comparisons the issue asks about, where both sides ran: each rollout's overlapped modes against its
    ``sync``, each vLLM rollout against ``hf`` in the same mode, and each of drivetrain's variants against
    each of TRL's (s/step, per round)."""
    pairs = []
    trls = [name for name in names if name.split("/")[0] in TRL_ROLLOUTS]
    for name in names:
        rollout, mode = name.split("/")
        if rollout in TRL_ROLLOUTS:
            continue
        pairs.extend((name, trl) for trl in trls)
        if mode != "sync" and f"{rollout}/sync" in names:
            pairs.append((name, f"{rollout}/sync"))
        if rollout != "hf" and f"hf/{mode}" in names:
            pairs.append((name, f"hf/{mode}"))
    return pairs


if __name__ == "__main__":
    sys.exit(main())

"""GRPO steps per minute and held-out accuracy by ``trainer.mode`` on the embedded task (prints JSON).

One SFT warm start (the embedded job's: ``trainer.warm_start_steps`` steps of ``builtin:arithmetic``) is made
once; then each mode trains the same number of GRPO steps from it, with the same prompts, seeds and
hyper-parameters (the embedded job's defaults), in this process: ``sync``, ``one_step_off``, and ``async``
with ``trainer.max_staleness`` as given (``async:2``). Per mode it reports the GRPO loop's wall seconds and
steps per minute, the seconds generating, training and overlapped (summed over steps, from ``summary.json``),
the samples trained and dropped, and the held-out greedy accuracy before and after (the same number of
samples seen in every mode).

What to expect here: on a CPU-only machine the rollout thread and the trainer share the cores, so overlap buys
little (two cores: at most the part of generation that does not compete with the update for them); with the
rollout on its own devices (disaggregated placement) generation of step ``k + 1`` hides behind step ``k``'s
update, up to ``min(generating, training)`` seconds per step. Off-policy samples may also change accuracy per
sample: report both.

Run: ``uv run --all-packages python benchmarks/grpo_async_benchmark.py [--steps 120] [--modes sync,one_step_off,async:2]``;
``--tiny`` (3 warm-start steps, 2 GRPO steps of 4 prompts) is the dry run that checks the script, not a
measurement. Timings need a quiet machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from pathlib import Path
from typing import Any


def mode_overrides(mode: str) -> list[str]:
    """``sync``, ``one_step_off`` or ``async:<max_staleness>`` as config overrides."""
    name, _, staleness = mode.partition(":")
    return [f"trainer.mode={name}", *([f"trainer.max_staleness={staleness}"] if staleness else [])]


def size_overrides(args: argparse.Namespace) -> list[str]:
    """The loop's size: the embedded job's, or the dry run's."""
    if args.tiny:
        return [
            "trainer.total_steps=2",
            "trainer.prompts_per_step=4",
            "trainer.eval_samples=8",
            "rollout.n=4",
        ]
    return [f"trainer.total_steps={args.steps}"]


def warm_start(directory: Path, sizes: list[str], tiny: bool) -> str:
    """The embedded job's SFT warm start, made once for every mode."""
    from drivetrain_roles.grpo.config import load_config
    from drivetrain_roles.rl.warm_start import start_model

    steps = ["trainer.warm_start_steps=3"] if tiny else []
    config = load_config(None, [*sizes, *steps, "trainer.progress_bar=false"])
    return start_model(config, directory, resume=False)


def run_mode(mode: str, model: str, directory: Path, sizes: list[str]) -> dict[str, Any]:
    """One GRPO run from ``model`` in ``mode``; its speed and accuracy."""
    from drivetrain_roles.grpo.config import load_config
    from drivetrain_roles.grpo.trainer import GRPOTrainer

    defaults = load_config()  # the embedded job's values, which a model directory would otherwise replace
    config = load_config(
        None,
        [
            f"model.path={model}",
            f"optimizer.lr={defaults.optimizer.lr}",
            f"rollout.max_new_tokens={defaults.rollout.max_new_tokens}",
            f"data.max_length={defaults.data.max_length}",
            "trainer.save_every=0",
            "trainer.progress_bar=false",
            *sizes,
            *mode_overrides(mode),
        ],
    )
    result = GRPOTrainer(config, directory / mode.replace(":", "-")).run()
    summary = json.loads((directory / mode.replace(":", "-") / "summary.json").read_text())
    steps = config.trainer.total_steps
    return {
        "mode": mode,
        "steps": steps,
        "samples": steps * config.trainer.prompts_per_step * config.rollout.n,
        "loop_seconds": round(result.seconds, 2),
        "steps_per_minute": round(60 * steps / result.seconds, 2),
        "seconds": {k: round(v, 2) for k, v in summary["timing_seconds"].items()},
        "dropped_samples": summary["dropped_samples"],
        "val_accuracy_first": result.evaluations[0]["val/accuracy"],
        "val_accuracy_last": result.evaluations[-1]["val/accuracy"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=120, help="GRPO steps per mode (the embedded job's 120)")
    parser.add_argument("--modes", default="sync,one_step_off,async:2", help="comma-separated modes")
    parser.add_argument("--tiny", action="store_true", help="dry run: checks the script, measures nothing")
    parser.add_argument("--output", type=Path, default=None, help="where the runs go (default: a temp dir)")
    args = parser.parse_args(argv)
    sizes = size_overrides(args)
    # The runs' progress lines go to stderr, so that stdout is the JSON alone.
    with tempfile.TemporaryDirectory() as scratch, contextlib.redirect_stdout(sys.stderr):
        directory = args.output or Path(scratch)
        model = warm_start(directory / "warm", sizes, args.tiny)
        results = [run_mode(mode, model, directory, sizes) for mode in args.modes.split(",")]
    print(json.dumps({"tiny": args.tiny, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

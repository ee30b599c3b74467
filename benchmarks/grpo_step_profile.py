"""Where a ``drivetrain grpo`` step's CPU goes: the step's phases timed in-process, optionally under cProfile.

Runs :class:`~drivetrain_roles.grpo.trainer.GRPOTrainer` in this process (one rank, one CPU thread) from a
model directory (give the ``final_model`` of a warm start, so that no SFT runs first), and reads the process's
CPU seconds around each step and around its phases: generation, the old-log-prob, reference and update
passes, the weight hand-off, and the rest (rewards, batch building, metrics). The steps before ``--skip`` are
left out (warm-up). With ``--profile FILE`` the measured steps also run under cProfile (``pstats`` file; the
profiler's own cost inflates the phases, so read its proportions, not its seconds).

    uv run --all-packages python benchmarks/grpo_step_profile.py --model RUN/warm_start/final_model

On a shared machine compare only runs alternated in the same window (old code, new code, old, new): one
timing says little. Extra arguments are the command's overrides (``algorithm.ppo_mini_batches=1``).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

PHASES = {
    "generate": ("rollout", "generate"),
    "old_log_prob": ("actor", "compute_log_prob"),
    "reference": ("reference", "compute_ref_log_prob"),
    "update": ("actor", "update_policy"),
    "hand_off": ("rollout", "update_weights"),
}


def timed(seconds: dict[str, float], name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` adding its CPU seconds to ``seconds[name]``."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.process_time()
        try:
            return function(*args, **kwargs)
        finally:
            seconds[name] += time.process_time() - started

    return wrapper


def measure(model: str, steps: int, skip: int, overrides: list[str], profile: str | None) -> dict[str, Any]:
    """CPU seconds per measured step, in all and by phase (medians over the steps after ``skip``)."""
    from drivetrain_roles.grpo.config import load_config
    from drivetrain_roles.grpo.trainer import GRPOTrainer

    config = load_config(
        None,
        [
            f"model.path={model}",
            f"trainer.total_steps={steps}",
            "trainer.eval_every=0",
            "trainer.save_every=0",
            "trainer.eval_samples=0",
            "trainer.progress_bar=false",
            *overrides,
        ],
    )
    per_step: list[dict[str, float]] = []
    profiler = cProfile.Profile() if profile else None

    class Timed(GRPOTrainer):
        def _setup(self) -> Any:
            engine = super()._setup()
            # NOTE: the pipeline calls the rollout's generate on the trainer's thread in sync mode.
            self.phase_seconds: dict[str, float] = defaultdict(float)
            for name, (owner, method) in PHASES.items():
                target = getattr(self, owner)
                if target is not None:
                    setattr(target, method, timed(self.phase_seconds, name, getattr(target, method)))
            return engine

        def _step(self, step: int, result: Any) -> dict[str, float]:
            self.phase_seconds.clear()
            measured = step >= skip
            if profiler is not None and measured:
                profiler.enable()
            started = time.process_time()
            values = super()._step(step, result)
            total = time.process_time() - started
            if profiler is not None and measured:
                profiler.disable()
            if measured:
                phases = dict(self.phase_seconds)
                phases["other"] = total - sum(phases.values())
                per_step.append({"total": total, **phases})
            return values

    with tempfile.TemporaryDirectory() as run:
        Timed(config, run).run()
    if profiler is not None and profile:
        profiler.dump_stats(profile)
    names = per_step[0].keys() if per_step else ()
    return {
        "steps_measured": len(per_step),
        "cpu_s_per_step_median": {n: round(statistics.median(s[n] for s in per_step), 4) for n in names},
        "cpu_s_per_step": [round(s["total"], 4) for s in per_step],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True, help="a model directory (a warm start's final_model)")
    parser.add_argument("--steps", type=int, default=12, help="GRPO steps in all")
    parser.add_argument("--skip", type=int, default=4, help="warm-up steps left out of the figures")
    parser.add_argument("--profile", default=None, help="write a cProfile pstats file of the measured steps")
    args, overrides = parser.parse_known_args()
    print(json.dumps(measure(args.model, args.steps, args.skip, overrides, args.profile)))


if __name__ == "__main__":
    main()

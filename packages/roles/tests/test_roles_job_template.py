"""A new command is one subclass of the job template and one call of the command factory.

The toy job below trains nothing: its step's record is a formula of the step, its evaluation another, so the
run folder the template writes (``config.yaml``, ``metrics.jsonl``, checkpoints, ``summary.json``, the final
model, the printed report) can be checked against the formulas written out here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from drivetrain_engine_core.backend import Engine, EngineConfig, ModelConfig, OptimizerConfig
from drivetrain_engine_core.job import complete_steps
from drivetrain_engine_core.testing import make_tiny_model_dir
from drivetrain_roles.command_sections import BatchLoopConfig
from drivetrain_roles.jobs.command import job_command
from drivetrain_roles.jobs.job import JobResult, TrainingJob
from drivetrain_roles.runtime.tracking import read_records


@dataclass(kw_only=True, frozen=True)
class ToyTrainerConfig(BatchLoopConfig):
    total_steps: int = 4
    batch_size: int = 1
    eval_every: int = 2
    save_every: int = 0
    progress_bar: bool = False


@dataclass(kw_only=True, frozen=True)
class ToyConfig:
    model: ModelConfig = field(default_factory=lambda: ModelConfig(path="unset"))
    engine: EngineConfig = field(default_factory=EngineConfig)
    trainer: ToyTrainerConfig = field(default_factory=ToyTrainerConfig)


@dataclass
class ToyResult(JobResult):
    values: list[float] = field(default_factory=list)


def train_value(step: int) -> float:
    return (step + 1) ** 2 / 4


def eval_value(done: int) -> float:
    return 10.0 - done


class ToyJob(TrainingJob[ToyResult]):
    """The smallest job: an engine to checkpoint, a step and an evaluation that are formulas."""

    command = "toy"
    result_type = ToyResult

    def _setup(self) -> Engine:
        from drivetrain_engine_core.job import create_engine

        engine = create_engine(
            model_config=self.config.model,
            engine_config=self.config.engine,
            optimizer_config=OptimizerConfig(lr=0.0, weight_decay=0.0),
        )
        engine.initialize()
        return engine

    def _step(self, step: int, result: ToyResult) -> dict[str, float]:
        result.values.append(train_value(step))
        return {"train/loss": train_value(step)}

    def _evaluate(self, step: int) -> dict[str, float]:
        return {"val/loss": eval_value(step)}

    def _postfix(self, values: dict[str, float]) -> dict[str, str]:
        return {"loss": f"{values['train/loss']:.2f}"}  # the default shows step_record's speed keys too

    def _save_final(self, engine: Engine, target: Path) -> None:
        target.mkdir(parents=True, exist_ok=True)
        (target / "toy.txt").write_text("final")

    def _summary(self, result: ToyResult) -> dict[str, Any]:
        return {
            "start_step": result.start_step,
            "last_value": result.values[-1],
            "evaluations": result.evaluations,
        }


toy = job_command("toy", job=ToyJob, config=ToyConfig, help="A toy job.")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("toy-model"), arch="qwen2", with_tokenizer=False)


def test_a_subclass_of_the_template_runs_through_the_command_factory(tmp_path, model_dir) -> None:
    run = tmp_path / "run"
    args = ["--output-dir", str(run), f"model.path={model_dir}", "engine.backend=fsdp", "engine.device=cpu"]
    result = CliRunner().invoke(toy, args)
    assert result.exit_code == 0, result.output

    steps = range(1, 5)
    records = read_records(run / "metrics.jsonl")
    train = {r["step"]: r["train/loss"] for r in records if "train/loss" in r}
    evaluations = [{"step": s, "val/loss": eval_value(s)} for s in (0, 2, 4)]
    assert train == {s: pytest.approx(train_value(s - 1)) for s in steps}
    assert [{"step": r["step"], "val/loss": r["val/loss"]} for r in records if "val/loss" in r] == evaluations
    summary = json.loads((run / "summary.json").read_text())
    assert summary["start_step"] == 0
    assert summary["last_value"] == train_value(3)
    assert summary["evaluations"] == evaluations
    assert summary["final_model"] == str(run / "final_model")
    assert summary["config"]["trainer"]["total_steps"] == 4
    assert (run / "config.yaml").is_file() and (run / "loss_curve.png").is_file()
    assert (run / "final_model" / "toy.txt").read_text() == "final"
    assert [step for step, _ in complete_steps(run / "checkpoints")] == [4]
    assert "val/loss: 10.0000 (step 0) -> 6.0000 (step 4)" in result.output
    assert f"run directory: {run}" in result.output

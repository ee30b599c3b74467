"""Rewards as a run uses them: ``drivetrain grpo`` and ``drivetrain ppo`` on a prompt-only data set (no reference
column, ``data.response_key=null``) with two weighted functions, one reading a data set column and returning None
where it does not apply. The functions record what they returned; each step's ``train/reward`` and
``reward/<name>``, and each held-out evaluation's ``val/reward`` and ``val/reward/<name>``, are recomputed from
those records by hand."""

from __future__ import annotations

import json
import math

import pytest
from drivetrain_engine_core.backend import ConfigError
from drivetrain_roles.command_sections import DataConfig
from drivetrain_roles.jobs.data import tokenize_row

FUNCTIONS = """
import json
import threading

LOG = {log!r}
_lock = threading.Lock()


def _record(name, values):
    with _lock, open(LOG, "a") as log:
        log.write(json.dumps({{"name": name, "values": values}}) + "\\n")


def length(completions, **kwargs):
    values = [float(len(c)) for c in completions]
    _record("length", values)
    return values


def hits(completions, target):
    values = [None if t == "" else 1.0 if t in c else -1.0 for c, t in zip(completions, target)]
    _record("hits", values)
    return values
"""

WEIGHTS = {"length": 0.25, "hits": -2.0}


def write_rows(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


@pytest.mark.parametrize("command", ["grpo", "ppo"])
def test_a_prompt_only_data_set_trains_on_two_weighted_rewards(tmp_path, command, plotted):
    from click.testing import CliRunner
    from drivetrain_engine_core._cli import main as drivetrain_cli
    from drivetrain_roles.jobs.default_assets import write_model_dir

    model_dir = write_model_dir(tmp_path / "model", seed=3)
    log = tmp_path / "calls.jsonl"
    (tmp_path / "rewards.py").write_text(FUNCTIONS.format(log=str(log)))
    rows = [{"prompt": f"{a}+{a}=", "target": "" if a % 2 else str(2 * a)} for a in range(1, 9)]
    write_rows(tmp_path / "train.jsonl", rows)
    write_rows(tmp_path / "val.jsonl", rows[:2])
    functions = ",".join(f"{tmp_path / 'rewards.py'}:{name}" for name in WEIGHTS)
    overrides = [
        f"model.path={model_dir}",
        f"data.train_files=[{tmp_path / 'train.jsonl'}]",
        f"data.val_files=[{tmp_path / 'val.jsonl'}]",
        "data.response_key=null",
        f"algorithm.reward_functions=[{functions}]",
        f"algorithm.reward_weights=[{WEIGHTS['length']},{WEIGHTS['hits']}]",
        "rollout.n=4",
        "rollout.max_new_tokens=4",
        "trainer.total_steps=2",
        "trainer.prompts_per_step=4",
        "trainer.eval_every=0",
        "trainer.eval_samples=2",
        "trainer.save_every=0",
        "trainer.progress_bar=false",
    ]
    if command == "ppo":
        overrides.append("trainer.critic_warmup=0")
    run = tmp_path / "run"
    result = CliRunner().invoke(drivetrain_cli, [command, "--output-dir", str(run), *overrides])
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "train/reward" in r]
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    # A step scores 4 prompts x 4 responses; an evaluation, 2 greedy answers.
    training = {
        name: [c["values"] for c in calls if c["name"] == name and len(c["values"]) == 16] for name in WEIGHTS
    }
    assert [r["step"] for r in steps] == [1, 2] and len(training["length"]) == len(training["hits"]) == 2
    for record, lengths, hits in zip(steps, training["length"], training["hits"], strict=True):
        # The weighted sum of each response, the hits left out where they do not apply (odd a: no target).
        totals = [
            WEIGHTS["length"] * n + (0.0 if h is None else WEIGHTS["hits"] * h)
            for n, h in zip(lengths, hits, strict=True)
        ]
        applied = [h for h in hits if h is not None]
        assert record["train/reward"] == pytest.approx(sum(totals) / 16, rel=1e-6)
        assert record["reward/length"] == pytest.approx(sum(lengths) / 16, rel=1e-6)
        assert record["reward/hits"] == pytest.approx(sum(applied) / len(applied), rel=1e-6)
        assert 0 < len(applied) < 16
    evaluations = [r for r in records if "val/reward" in r]
    assert evaluations and all(
        "val/accuracy" not in r and math.isfinite(r["val/reward"]) for r in evaluations
    )
    # Held out, per function: its mean over the 2 greedy answers it applies to (hits: the even row's only), and
    # their weighted sum as val/reward; before the first step and after the last.
    held_out = {
        name: [c["values"] for c in calls if c["name"] == name and len(c["values"]) == 2] for name in WEIGHTS
    }
    assert len(evaluations) == len(held_out["length"]) == len(held_out["hits"]) == 2
    for record, lengths, hits in zip(evaluations, held_out["length"], held_out["hits"], strict=True):
        assert hits[0] is None and hits[1] in (1.0, -1.0)
        assert record["val/reward/length"] == pytest.approx(sum(lengths) / 2, rel=1e-6)
        assert record["val/reward/hits"] == pytest.approx(hits[1], rel=1e-6)
        totals = WEIGHTS["length"] * sum(lengths) + WEIGHTS["hits"] * hits[1]
        assert record["val/reward"] == pytest.approx(totals / 2, rel=1e-6)
    series = plotted(run / "reward_curve.png")  # checked against metrics.jsonl there
    assert {f"{s}/{name}" for s in ("reward", "val/reward") for name in WEIGHTS} <= set(series)
    assert (
        series["val/reward/hits"]["label"] == "hits (held-out)" and series["val/reward/hits"]["points"] == 2
    )


def test_prompt_only_rows_tokenise_as_prompts(tmp_path):
    from drivetrain_roles.jobs.default_assets import build_arithmetic_tokenizer
    from drivetrain_roles.jobs.multistep_task import write_multistep_model

    tokenizer = build_arithmetic_tokenizer()
    row = {"prompt": "12+7=", "answer": "19"}
    example = tokenize_row(row, tokenizer, DataConfig(response_key=None), where="t.jsonl row 0")
    assert example.prompt_ids == tokenizer("12+7=")["input_ids"] and example.response_ids == []
    assert not example.has_reference and example.columns == row and example.source == "t.jsonl row 0"
    from transformers import AutoTokenizer

    chat = AutoTokenizer.from_pretrained(write_multistep_model(tmp_path / "chat", 0))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Evaluate 3+4."}]
    config = DataConfig(messages_key="messages", response_key=None)
    example = tokenize_row({"messages": messages}, chat, config, where="c.jsonl row 0")
    rendered = chat.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    assert example.prompt_ids == list(getattr(rendered, "input_ids", rendered)) and not example.has_reference


def test_sft_refuses_rows_without_a_response():
    from drivetrain_roles.sft.config import load_config

    with pytest.raises(
        ConfigError, match=r"data.response_key=null .* is for grpo and ppo prompts; SFT trains on"
    ):
        load_config(None, ["data.response_key=null"])

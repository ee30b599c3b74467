"""An environment written outside drivetrain's packages works: the example plugin
(``examples/drivetrain-toy-environment``, a workspace member, so its entry point is installed as a user's
``pip install`` would) is listed by ``drivetrain plugins``, and ``drivetrain grpo environment.name=say-the-word``
trains two steps on ``hf`` with the rewards the game gives, recomputed here from the episodes' decoded turns."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner
from drivetrain_engine_core._cli import main as drivetrain_cli
from drivetrain_engine_core.testing import lean_model_dir, make_tiny_model_dir
from drivetrain_engine_core.testing.tokenizer import IM_END, build_tiny_tokenizer

WORDS = ["sit", "mist", "this", "kiss"]
LEANS = {"i": 0.9, "s": 0.9, "t": 0.8, IM_END: 0.75}
"""The tokens the test model's output leans towards whatever the context: turns end, and hold some of each
word's letters and not others."""


def test_the_example_environment_is_discovered_through_its_entry_point():
    result = CliRunner().invoke(drivetrain_cli, ["plugins", "--json"])
    assert result.exit_code == 0, result.output
    listed = {plugin["name"]: plugin for plugin in json.loads(result.output)}
    found = listed["toy-environment"]
    assert (found["distribution"], found["version"], found["status"]) == (
        "drivetrain-toy-environment",
        "0.1.1",
        "loaded",
    )
    assert found["registered"] == ["environment say-the-word -> drivetrain_toy_environment.game:SayTheWord"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny Qwen2 and its ChatML tokenizer, leaning towards :data:`LEANS` (:func:`lean_model_dir`)."""
    path = make_tiny_model_dir(tmp_path_factory.mktemp("model"), arch="qwen2")
    return lean_model_dir(path, build_tiny_tokenizer(), LEANS)


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory, model_dir):
    """``drivetrain grpo`` in ``say-the-word`` for two steps, a reward function that scores 0 (the game's rewards
    alone); each step's samples as the update got them, and the training records."""
    from drivetrain_roles.grpo import trainer as grpo_trainer

    folder = tmp_path_factory.mktemp("grpo")
    rows = [{"prompt": f"Say {w}.", "word": w, "response": w} for w in WORDS]
    (folder / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (folder / "zero.py").write_text(
        "def zero(*, completions, references):\n    return [0.0] * len(completions)\n"
    )
    overrides = [
        f"model.path={model_dir}",
        f"data.train_files=[{folder / 'train.jsonl'}]",
        "environment.name=say-the-word",
        "environment.options.turns=2",
        "environment.max_turns=2",
        "environment.max_total_tokens=128",
        f"algorithm.reward_function={folder / 'zero.py'}:zero",
        "rollout.n=3",
        "algorithm.ppo_mini_batches=1",
        "rollout.max_new_tokens=10",
        "trainer.prompts_per_step=2",
        "trainer.total_steps=2",
        "trainer.eval_samples=0",
        "trainer.progress_bar=false",
    ]
    seen, update = [], grpo_trainer.update

    def spy(actor, reference, samples):
        seen.append((samples.batch.clone(), samples.rewards.clone()))
        return update(actor, reference, samples)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(grpo_trainer, "update", spy)
        result = CliRunner().invoke(drivetrain_cli, ["grpo", "--output-dir", str(folder / "run"), *overrides])
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in (folder / "run" / "metrics.jsonl").read_text().splitlines()]
    return SimpleNamespace(seen=seen, records=[r for r in records if "train/reward" in r])


def game_reward(tokenizer, ids: torch.Tensor, mask: torch.Tensor) -> tuple[float, int]:
    """The episode's reward by the game's rule, written out: the word asked for is read from the context; each
    model turn that ended (with ``<|im_end|>``, so the game stepped on it) earns the share of the word's
    distinct letters its text holds, less 0.5. Also how many turns were stepped on."""
    context = tokenizer.decode(ids[: int(mask.nonzero()[0])])
    word = context.split("Say ")[1].split(".")[0]
    end, total, stepped = tokenizer.convert_tokens_to_ids(IM_END), 0.0, 0
    edges = torch.diff(torch.cat([torch.zeros(1), mask.float(), torch.zeros(1)])).nonzero().squeeze(-1)
    for start, stop in zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True):
        if int(ids[stop - 1]) != end:
            continue
        text = tokenizer.decode(ids[start:stop], skip_special_tokens=True)
        total += len(set(word) & set(text)) / len(set(word)) - 0.5
        stepped += 1
    return total, stepped


def test_grpo_trains_on_the_rewards_the_plugin_environment_gives(grpo_run):
    tokenizer = build_tiny_tokenizer()
    assert len(grpo_run.seen) == len(grpo_run.records) == 2
    stepped = 0
    for (batch, rewards), record in zip(grpo_run.seen, grpo_run.records, strict=True):
        expected = [
            game_reward(tokenizer, ids, mask)
            for ids, mask in zip(batch["input_ids"].unbind(), batch["loss_mask"].unbind(), strict=True)
        ]
        print([round(r, 4) for r in rewards.tolist()], record["rollout/turns"])
        torch.testing.assert_close(rewards, torch.tensor([r for r, _ in expected]), atol=1e-6, rtol=0)
        assert record["train/reward"] == pytest.approx(float(rewards.mean()), abs=1e-6)
        assert 1 < record["rollout/turns"] <= 2
        stepped += sum(s for _, s in expected)
    assert stepped >= 12  # most of the 12 episodes' turns were stepped on
    every = torch.cat([rewards for _, rewards in grpo_run.seen])
    assert len(set(every.tolist())) > 2 and (every < 0).any()  # graded, and negative for some episodes

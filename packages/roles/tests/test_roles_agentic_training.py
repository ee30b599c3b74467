"""GRPO and PPO on multi-turn trajectories (``environment.name``): the model's tokens exactly as sampled, only
they in the loss, per-turn rewards into GAE.

A tiny Qwen2 whose output leans towards ``i``, ``s`` and ``<|im_end|>`` (turns end, and hold ``i``, ``s`` that
the tokenizer would re-encode as the single token ``is``) plays three-turn episodes of an environment that a
plugin registers; its tool results are rendered by a tool-aware ChatML template, and its first prompts are
longer than a KV block. One ``drivetrain grpo`` run of two steps is checked against a plain Hugging Face forward
and against the policy loss written out here; GAE over model tokens against a per-sequence GAE written here.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner
from drivetrain_engine_core._cli import main as drivetrain_cli
from drivetrain_engine_core._hookspecs import PROJECT_NAME
from drivetrain_engine_core._plugins import get_plugin_manager, reset_plugins
from drivetrain_engine_core.backend import hookimpl
from drivetrain_engine_core.job import Environment, ModelTurn, StepResult, plugins
from drivetrain_engine_core.testing.plugins import InMemoryEntryPoint
from drivetrain_roles.environments import tool_schema
from drivetrain_roles.grpo import trainer as grpo_trainer
from transformers import AutoModelForCausalLM

TEMPERATURE = 0.9
ENVIRONMENT = ("environment.name=lookup-game", "environment.max_turns=3", "environment.max_total_tokens=700")
QUESTIONS = [
    "hello world, the answer is what? Think about it step by step, then say it.",
    "the world is round; is the answer to the question of the world this one, or that one?",
]


def lookup(word: str) -> str:
    """Look a word up in the dictionary.

    Args:
        word: the word to look up.
    """
    return word


class LookupGame(Environment):
    """Three turns; after each the tool answers. Turn ``k`` earns ``k / 2 - 0.3`` plus 0.1 per ``s`` in it (graded,
    negative for the first), and reports one tool call (an error on turn 1)."""

    def tool_schemas(self):
        return [tool_schema(lookup)]

    def _reset(self, example):
        return [{"role": "user", "content": example["question"]}]

    def _step(self, turn: ModelTurn) -> StepResult:
        return StepResult(
            observation=[{"role": "tool", "content": f"turn {turn.turn}: {lookup('hello')}"}],
            reward=turn.turn / 2 - 0.3 + 0.1 * turn.text.count("s"),
            done=turn.turn == 2,
            info={"tool_calls": 1, "tool_errors": int(turn.turn == 1)},
        )


@hookimpl
def register_environments(registry):
    registry.register("lookup-game", LookupGame)


@pytest.fixture(scope="module")
def game_plugin():
    """The installed plugins and one more, registering ``lookup-game`` (as a plugin outside the repo would)."""
    plugin = SimpleNamespace(register_environments=register_environments)
    entry = InMemoryEntryPoint(name="lookup-game", plugin=plugin, distribution="drivetrain-lookup-game")
    installed = list(importlib.metadata.entry_points(group=PROJECT_NAME))
    reset_plugins()
    yield plugins(lambda: get_plugin_manager(entry_points=[*installed, entry], disabled=[]))
    reset_plugins()


@pytest.fixture(scope="module")
def tokenizer(tool_tokenizer):
    return tool_tokenizer


@pytest.fixture(scope="module")
def model_dir(leaning_model_dir):
    return leaning_model_dir


def write_rows(path):
    """The data set: the environment starts from each row's ``question``; ``prompt`` is what the data checks read,
    ``response`` what the reward function compares the final turn with."""
    rows = [{"prompt": "hello world", "question": q, "response": "is"} for q in QUESTIONS]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory, model_dir, game_plugin, tokenizer):
    """Two ``drivetrain grpo`` steps in ``lookup-game``; the batch of step 0 (as the update got it, before it)
    and the update's metrics of each step."""
    folder = tmp_path_factory.mktemp("grpo")
    write_rows(folder / "train.jsonl")
    overrides = [
        f"model.path={model_dir}",
        f"data.train_files=[{folder / 'train.jsonl'}]",
        "rollout.n=3",
        f"rollout.temperature={TEMPERATURE}",
        "rollout.max_new_tokens=12",
        "trainer.prompts_per_step=2",
        "trainer.total_steps=2",
        "trainer.eval_samples=0",
        "trainer.progress_bar=false",
        "algorithm.kl_loss_coef=0",
        "algorithm.ppo_mini_batches=1",
        "optimizer.lr=1e-3",
        *ENVIRONMENT,
    ]
    seen = []
    update = grpo_trainer.update

    def spy(actor, reference, samples):
        batch = samples.batch.clone()
        metrics = update(actor, reference, samples)
        seen.append((batch, samples, metrics))
        return metrics

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(grpo_trainer, "update", spy)
        result = CliRunner().invoke(drivetrain_cli, ["grpo", "--output-dir", str(folder / "run"), *overrides])
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in (folder / "run" / "metrics.jsonl").read_text().splitlines()]
    return SimpleNamespace(seen=seen, records=[r for r in records if "train/reward" in r])


def forward_log_probs(model, ids: torch.Tensor) -> torch.Tensor:
    """``(len(ids),)`` a plain forward's log-prob of each token after its context at the temperature (0 at 0)."""
    with torch.no_grad():
        logits = model(input_ids=ids[None]).logits[0, :-1].float() / TEMPERATURE
    return torch.cat([torch.zeros(1), torch.log_softmax(logits, -1).gather(-1, ids[1:, None]).squeeze(-1)])


def test_the_actor_recomputes_the_sampled_log_probs_of_the_model_tokens(grpo_run, model_dir, tokenizer):
    batch, _, metrics = grpo_run.seen[0]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    masks, rolled = batch["loss_mask"].unbind(), batch["rollout_log_probs"].unbind()
    gap, retokenised_gap, changed_turns = 0.0, 0.0, 0
    for ids, mask, rollout_log_probs in zip(batch["input_ids"].unbind(), masks, rolled, strict=True):
        assert mask.sum() > 0 and (~mask).sum() > 200  # model tokens, and a long context around them
        forward = forward_log_probs(model, ids)
        gap = max(gap, float((forward - rollout_log_probs)[mask].abs().max()))
        # The same check on the turns re-tokenised from their text: other ids, other log-probs.
        starts = (mask[1:] & ~mask[:-1]).nonzero().squeeze(-1) + 1
        stops = (~mask[1:] & mask[:-1]).nonzero().squeeze(-1) + 1
        pieces, cursor = [], 0
        for start, stop in zip(starts.tolist(), [*stops.tolist(), len(ids)], strict=False):
            turn = ids[start:stop].tolist()
            again = tokenizer(tokenizer.decode(turn), add_special_tokens=False)["input_ids"]
            changed_turns += again != turn
            pieces += [ids[cursor:start], torch.tensor(again, dtype=torch.long)]
            cursor = stop
        retokenised = torch.cat([*pieces, ids[cursor:]])
        if len(retokenised) == len(ids):
            continue
        shifted = forward_log_probs(model, retokenised)[: int(mask.nonzero().max()) + 1]
        retokenised_gap = max(
            retokenised_gap, float((shifted[: len(ids)] - rollout_log_probs[: len(shifted)]).abs().max())
        )
    print(
        f"gap {gap:.3g}, metric {metrics['rollout/log_prob_diff_max']:.3g}, re-tokenised {retokenised_gap:.3g} "
        f"({changed_turns} turns re-encode differently)"
    )
    assert gap < 1e-5
    assert metrics["rollout/log_prob_diff_max"] < 1e-5
    assert metrics["rollout/log_prob_diff_max"] == pytest.approx(gap, abs=2e-6)
    assert changed_turns >= 3 and retokenised_gap > 0.5  # what re-tokenising a turn would have trained on


def test_the_policy_loss_is_the_token_mean_over_model_tokens_only(grpo_run):
    batch, _, metrics = grpo_run.seen[0]
    advantages = batch["advantages"].values()
    lengths = batch["input_ids"].offsets().diff()
    # The model's tokens, read from the rollout (a sampled token's log-prob is never 0; context tokens carry 0).
    mask = batch["rollout_log_probs"].values() != 0
    # One mini-batch whose old log-probs are the current ones: ratio 1, so pg_loss is minus the token-mean
    # advantage over the model tokens.
    model_tokens = -float(advantages[mask].mean())
    # With every token after the first prompt in the loss (observations too), each episode's advantage would
    # weigh in by its whole length instead.
    episode = torch.stack(
        [a[m].mean() for a, m in zip(batch["advantages"].unbind(), mask.split(lengths.tolist()), strict=True)]
    )
    after_prompt = (lengths - batch["prompt_lengths"]).float()
    all_tokens = -float((episode * after_prompt).sum() / after_prompt.sum())
    print(
        f"pg_loss {metrics['pg_loss']:.6g}, model tokens {model_tokens:.6g}, observations too {all_tokens:.6g}"
    )
    assert (advantages[~mask] == 0).all()
    assert metrics["pg_loss"] == pytest.approx(model_tokens, rel=1e-5, abs=1e-7)
    assert abs(all_tokens - model_tokens) > 0.01
    assert torch.equal(batch["loss_mask"].values(), mask)


def test_a_grpo_run_in_a_plugin_environment_has_finite_metrics_and_per_turn_rewards(grpo_run):
    assert len(grpo_run.records) == 2
    for record in grpo_run.records:
        assert all(math.isfinite(v) for v in record.values() if isinstance(v, float))
        assert 1 < record["rollout/turns"] <= 3
        assert record["rollout/tool_calls"] == pytest.approx(
            record["rollout/turns"] - record["rollout/stop_truncated"] * 0, abs=1.5
        )
        stops = sum(v for k, v in record.items() if k.startswith("rollout/stop_"))
        assert stops == pytest.approx(1.0)
    _, samples, _ = grpo_run.seen[0]
    token_rewards = samples.batch["token_rewards"]
    assert ((token_rewards.values() != 0).sum()) > len(samples.rewards)  # several turns rewarded per episode
    torch.testing.assert_close(torch.stack([r.sum() for r in token_rewards.unbind()]), samples.rewards)
    assert grpo_run.records[0]["train/reward"] == pytest.approx(float(samples.rewards.mean()), rel=1e-6)


def per_sequence_gae(rewards, values, mask, gamma, lam):
    """GAE over one sequence's model tokens alone (context tokens skipped), scattered back; 0 at context."""
    index = mask.nonzero().squeeze(-1)
    r, v = rewards[index].double(), values[index].double()
    advantages, following, following_value = torch.zeros_like(r), 0.0, 0.0
    for t in reversed(range(len(index))):
        delta = r[t] + gamma * following_value - v[t]
        following = delta + gamma * lam * following
        advantages[t], following_value = following, v[t]
    out = torch.zeros(len(mask), dtype=torch.float64)
    out[index] = advantages
    return out


def test_ppo_runs_gae_over_each_episodes_model_tokens_with_its_turn_rewards(tmp_path, model_dir, game_plugin):
    from drivetrain_roles.ppo import step as ppo_step
    from drivetrain_roles.ppo.config import load_config
    from drivetrain_roles.ppo.trainer import PPOTrainer

    write_rows(tmp_path / "train.jsonl")
    config = load_config(
        None,
        [
            f"model.path={model_dir}",
            f"data.train_files=[{tmp_path / 'train.jsonl'}]",
            "rollout.n=2",
            f"rollout.temperature={TEMPERATURE}",
            "rollout.max_new_tokens=12",
            "trainer.prompts_per_step=2",
            "trainer.total_steps=1",
            "trainer.critic_warmup=0",
            "trainer.eval_samples=0",
            "trainer.progress_bar=false",
            "algorithm.ppo_mini_batches=1",
            "algorithm.gamma=0.9",
            "algorithm.lam=0.8",
            *ENVIRONMENT,
        ],
    )
    calls, gae = [], ppo_step.compute_gae

    def spy(rewards, values, loss_mask, *, gamma, lam):
        out = gae(rewards, values, loss_mask, gamma=gamma, lam=lam)
        calls.append((rewards, values, loss_mask, out[0]))
        return out

    seen, update = [], ppo_step.update_with

    def spy_update(calls_, samples, *args, **kwargs):
        seen.append(samples.batch["token_rewards"].clone())
        return update(calls_, samples, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ppo_step, "compute_gae", spy)
        patch.setattr(ppo_step, "update_with", spy_update)
        result = PPOTrainer(config, tmp_path / "run").run()
    assert len(result.rewards) == 1 and math.isfinite(result.rewards[0])
    ((rewards, values, mask, advantages),) = calls
    compared = 0
    for r, v, m, a, turn_rewards in zip(
        rewards.unbind(), values.unbind(), mask.unbind(), advantages.unbind(), seen[0].unbind(), strict=True
    ):
        # The turn rewards at each turn's last token (the KL to the reference is 0 at the start model).
        assert (r[~m] == 0).all()
        torch.testing.assert_close(r[m], turn_rewards[m], atol=1e-5, rtol=0)
        expected = per_sequence_gae(r, v, m, 0.9, 0.8)
        torch.testing.assert_close(a.double(), expected, atol=1e-5, rtol=1e-5)
        # An episode with context between its turns and a reward on more than one of them.
        compared += int((m[1:] & ~m[:-1]).sum()) > 1 and int((turn_rewards[m] != 0).sum()) > 1
    assert compared >= 1


def test_router_replay_and_unknown_stop_tokens_are_refused_with_an_environment(tokenizer):
    from drivetrain_engine_core.backend import ConfigError
    from drivetrain_roles.grpo.config import load_config

    with pytest.raises(ConfigError, match=r"set rollout\.router_replay=disabled"):
        load_config(None, [*ENVIRONMENT, "rollout.router_replay=R3"])
    config = load_config(None, [*ENVIRONMENT, "environment.stop_tokens=[<|eot_id|>]"])
    with pytest.raises(ConfigError, match=r"'<\|eot_id\|>'\] is not a token of the model's tokenizer"):
        config.environment.stop_token_ids(tokenizer)
    assert load_config(None, list(ENVIRONMENT)).environment.stop_token_ids(tokenizer) == (
        tokenizer.convert_tokens_to_ids("<|im_end|>"),
    )

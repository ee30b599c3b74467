"""The embedded multi-step task (``model.path=builtin:multistep``): its graded reward on hand-made completions, the
shape of its prompts (a chat template, a shared system prefix longer than two KV blocks, answers of 20-100 tokens),
the defaults it brings, and ``drivetrain grpo``/``ppo`` on it end to end."""

from __future__ import annotations

import json

import pytest
import torch
from drivetrain_roles.grpo.config import load_config
from drivetrain_roles.grpo.trainer import GRPOTrainer
from drivetrain_roles.jobs.assets import ModelPathError, check_model_path, load_splits, resolve_model_path
from drivetrain_roles.jobs.builtin_tasks import MULTISTEP
from drivetrain_roles.jobs.multistep_task import SYSTEM_PROMPT, TURN_END, build_multistep_tokenizer
from drivetrain_roles.ppo.config import load_config as load_ppo_config
from drivetrain_roles.ppo.trainer import PPOTrainer
from drivetrain_roles.rl import rewards
from drivetrain_roles.rl.rewards import RewardError, compute_rewards
from drivetrain_roles.rl.step_credit import MALFORMED, step_credit, step_credit_reward

REFERENCE = "7+5=12; 12*3=36; 36-4=32; answer: 32"

# Each completion with its reward written out: half for the steps, each scored a quarter per part equal to the reference
# step's in its place (total, operator, number, result) and summed over the longer of the two step lists; half for the
# final answer; -1 for anything that is not steps and an answer.
GRADED = [
    (REFERENCE, 1.0),
    (f"  {REFERENCE}\n", 1.0),  # surrounding whitespace (the template's newline after the turn end)
    ("7+5=12; 12*3=36; 36-4=33; answer: 33", 0.5 * (1 + 1 + 3 / 4) / 3),
    ("7+5=13; 12*3=36; 36-4=32; answer: 32", 0.5 * (3 / 4 + 1 + 1) / 3 + 0.5),
    ("7+5=12; 12*3=36; 36-4=32; 32+0=32; answer: 32", 0.5 * 3 / 4 + 0.5),  # an extra step costs
    ("7+5=12; answer: 32", 0.5 * 1 / 3 + 0.5),  # so do missing ones
    ("7+5=11; 11*3=33; 33-4=29; answer: 29", 0.5 * (3 / 4 + 2 / 4 + 2 / 4) / 3),  # one slip carried through
    ("8-6=2; 2+1=3; answer: 3", 0.0),
    ("7+5=12; 12*3=36; 36-4=32", MALFORMED),  # no answer
    ("answer: 32", MALFORMED),  # no steps
    (f"{REFERENCE}\nuser\nEvaluate 3+4.", MALFORMED),  # ran on past its turn
    ("7+5=12;12*3=36; answer: 36", MALFORMED),  # separator
    ("", MALFORMED),
]


def test_step_credit_grades_each_completion_as_written_out():
    completions = [completion for completion, _ in GRADED]
    rewards = compute_rewards(
        "step_credit",
        prompts=[""] * len(GRADED),
        completions=completions,
        references=[REFERENCE] * len(GRADED),
    )
    torch.testing.assert_close(rewards, torch.tensor([reward for _, reward in GRADED]), rtol=0, atol=1e-7)
    with pytest.raises(
        RewardError, match=r"reference '19' is not worked steps and an answer .*builtin:multistep"
    ):
        compute_rewards("step_credit", prompts=["12+7="], completions=["19"], references=["19"])


def test_the_task_brings_its_reward_lengths_and_a_train_set_revisited():
    """Unless set: the graded reward, chat rows, 96 new tokens, eight responses a prompt, and fewer training prompts
    than the run samples (each is seen again); whatever the user sets wins."""
    config = load_config(None, ["model.path=builtin:multistep"])
    assert (config.algorithm.reward_function, config.data.messages_key, config.rollout.n) == (
        "step_credit",
        "messages",
        8,
    )
    assert config.rollout.max_new_tokens == 96 and config.data.max_length == 512
    assert config.trainer.total_steps * config.trainer.prompts_per_step > 2 * config.data.generated_train_size
    mine = load_config(None, ["model.path=builtin:multistep", "algorithm.reward_function=exact_match"])
    assert mine.algorithm.reward_function == "exact_match"
    # The arithmetic task's defaults are unchanged, and a task no entry names is one clear error.
    assert load_config().algorithm.reward_function == "exact_match"
    with pytest.raises(
        ModelPathError, match=r"^model.path=builtin:multi does not exist; .* an embedded model: "
    ):
        check_model_path("builtin:multi")


def test_prompts_share_a_system_prefix_over_two_kv_blocks_and_answers_end_their_turn(tmp_path):
    """Every prompt is the chat template's rendering of the same system turn (over 256 tokens: two vLLM CPU blocks
    of 128) and a problem; every response is 20-100 tokens of working, the turn end, and the EOS after it."""
    config = load_config(None, ["model.path=builtin:multistep", "data.generated_train_size=32"])
    model = resolve_model_path("builtin:multistep", tmp_path, seed=0)
    tokenizer, train, val = load_splits(model, config.data, tmp_path, seed=0, task=MULTISTEP)
    assert (len(train), len(val)) == (32, 100)
    # The shared prefix counted by hand: one token per character, one per special token.
    system_turn = 1 + len("system\n") + len(SYSTEM_PROMPT) + 1 + len("\n")
    shared = system_turn + 1 + len("user\nEvaluate ")
    prompts = [e.prompt_ids for e in train + val]
    common = next(i for i in range(len(prompts[0])) if len({tuple(p[: i + 1]) for p in prompts}) > 1)
    assert common == shared and system_turn > 2 * 128
    assert tokenizer.decode(prompts[0][:system_turn]) == f"<|im_start|>system\n{SYSTEM_PROMPT}{TURN_END}\n"
    end, eos = tokenizer.convert_tokens_to_ids(TURN_END), tokenizer.eos_token_id
    assert end != eos
    for example in train + val:
        assert example.response_ids[-3:] == [end, tokenizer.convert_tokens_to_ids("Ċ"), eos]
        assert 20 <= len(example.response_ids) <= 100
        assert len(example.response_ids) == len(example.response_text) + 3  # a token per character
    # The run folder's rows are chat messages, what a user's model and its own template could read too.
    row = json.loads((tmp_path / "data" / "train.jsonl").read_text().splitlines()[0])
    assert [m["role"] for m in row["messages"]] == ["system", "user", "assistant"]


COMMANDS = {"grpo": (load_config, GRPOTrainer), "ppo": (load_ppo_config, PPOTrainer)}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_grpo_and_ppo_train_on_the_task_with_its_graded_reward(command, tmp_path, monkeypatch):
    """Two steps of each command on the task's defaults, shrunk: the reward every step logs is the mean of the graded
    rewards of its completions, the prompts the reward sees open with the system prompt, the same two training
    prompts come back the second step (a train set smaller than a step's prompts times the steps), and the
    rollout's log-probs of the 400-token sequences are the actor's; the warm start's model stops at the turn end."""
    load, trainer = COMMANDS[command]
    seen: list[tuple[list[str], list[str], list[float]]] = []

    def spy(*, prompts, completions, references):
        graded = step_credit_reward(prompts=prompts, completions=completions, references=references)
        seen.append((prompts, references, graded))
        return graded

    monkeypatch.setitem(rewards.BUILTIN_REWARDS, "step_credit", spy)
    rewards.load_reward_function.cache_clear()
    shrunk = ["warm_start_steps=2", "warm_start_batch_size=2", "total_steps=2", "prompts_per_step=2"]
    shrunk += ["eval_every=0", "eval_samples=2", "save_every=0", "progress_bar=false"]
    overrides = [
        "model.path=builtin:multistep",
        *(f"trainer.{o}" for o in shrunk),
        "rollout.max_new_tokens=24",
    ]
    overrides += ["data.generated_train_size=2", "data.generated_val_size=2"]
    if command == "ppo":
        overrides.append("trainer.critic_warmup=0")
    config = load(None, overrides)
    job = trainer(config, tmp_path / "run")
    try:
        result = job.run()
    finally:
        rewards.load_reward_function.cache_clear()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "train/reward" in r]
    n = config.rollout.n
    # A step scores 2 prompts x n responses; each evaluation, 2 greedy answers.
    training = [call for call in seen if len(call[2]) == 2 * n]
    assert len(training) == 2 and [len(call[2]) for call in seen if call not in training] == [2, 2]
    for step, (prompts, references, graded) in zip(steps, training, strict=True):
        assert step["train/reward"] == pytest.approx(sum(graded) / len(graded), abs=1e-6)
        assert all(p.startswith(f"<|im_start|>system\n{SYSTEM_PROMPT}") for p in prompts)
        assert {step_credit(r, r) for r in references} == {1.0}  # the data's worked answers
        assert step["rollout/log_prob_diff_max"] < 1e-5
    assert set(training[0][1]) == set(training[1][1]) and len(set(training[0][1])) == 2
    # Held-out: each evaluation's val/reward is the mean graded reward of its 2 greedy answers, and the report says
    # how it moved (val/accuracy, exact working, alone hides a graded reward's progress).
    evaluations = [r for r in records if "val/reward" in r]
    for evaluation, (_, _, graded) in zip(evaluations, [c for c in seen if c not in training], strict=True):
        assert evaluation["val/reward"] == pytest.approx(sum(graded) / 2, abs=1e-6)
    first, last = evaluations[0]["val/reward"], evaluations[-1]["val/reward"]
    assert (
        f"val/reward: {first:.4f} (step 0) -> {last:.4f} (step 2, step_credit)"
        in job.report(result).splitlines()
    )
    tokenizer = build_multistep_tokenizer()
    generation = json.loads(
        (tmp_path / "run" / "warm_start" / "final_model" / "generation_config.json").read_text()
    )
    assert generation["eos_token_id"] == [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(TURN_END)]

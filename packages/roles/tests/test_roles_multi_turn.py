"""Multi-turn rollouts on ``hf``: one token sequence per episode, the model's turns exactly as sampled.

A tiny Qwen2 whose output leans towards ``i``, ``s`` and ``<|im_end|>`` (so turns end, and often hold ``i``, ``s``
that the tokenizer would re-encode as the single token ``is``) plays episodes of several turns in an
environment whose observations a tool-aware ChatML template renders. A plain Hugging Face forward over each
whole trajectory gives the recorded log-probs of the model's tokens, the sampled ids are kept where decoding
and re-encoding would change them, and the trajectory decodes to the template's rendering of the conversation.
"""

from __future__ import annotations

import pytest
import torch
from drivetrain_engine_core.job import Environment, ModelTurn, StepResult, create_rollout
from drivetrain_engine_core.rollout import SamplingConfig
from drivetrain_roles.environments import tool_schema
from drivetrain_roles.rollout.multi_turn import run_episodes
from drivetrain_roles.rollout.trajectory import trajectory_batch
from drivetrain_roles.rollout.turn_limits import TurnLimits
from transformers import AutoModelForCausalLM

TEMPERATURE = 0.9
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


class EchoEnvironment(Environment):
    """Three turns: after each turn the user says which turn it was; turn ``k`` earns ``k / 4``. It offers a
    tool (never called), so every rendering carries the template's tool list."""

    def tool_schemas(self):
        return [tool_schema(lookup)]

    def _reset(self, example):
        return [{"role": "user", "content": example["prompt"]}]

    def _step(self, turn: ModelTurn) -> StepResult:
        return StepResult(
            observation=[{"role": "user", "content": f"turn {turn.turn} is over; hello again"}],
            reward=turn.turn / 4,
            done=turn.turn == 2,
        )


@pytest.fixture(scope="module")
def tokenizer(tool_tokenizer):
    return tool_tokenizer


@pytest.fixture(scope="module")
def model_dir(leaning_model_dir):
    return leaning_model_dir


def recording(rollout):
    """Wrap ``rollout.generate`` to keep, per context, every (sampled ids, sampled log-probs) it answered."""
    seen: dict[tuple[int, ...], list[tuple[list[int], torch.Tensor]]] = {}
    generate = rollout.generate

    def spy(prompts, sampling):
        output = generate(prompts, sampling)
        for prompt, ids, log_probs in zip(prompts, output.responses, output.log_probs, strict=True):
            seen.setdefault(tuple(prompt), []).append((ids.tolist(), log_probs))
        return output

    rollout.generate = spy
    return seen


def test_trajectories_hold_the_sampled_tokens_and_a_forward_gives_their_log_probs(model_dir, tokenizer):
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    rollout = create_rollout("hf", model_path=str(model_dir))
    sampled = recording(rollout)
    sampling = SamplingConfig(
        n=3, temperature=TEMPERATURE, max_new_tokens=12, seed=5, stop_token_ids=(im_end,)
    )
    trajectories = run_episodes(
        rollout,
        tokenizer,
        EchoEnvironment,
        [{"prompt": q} for q in QUESTIONS],
        sampling,
        TurnLimits(max_turns=3, max_total_tokens=700),
    )
    assert len(trajectories) == 6 and all(t.prompt_length > 200 for t in trajectories)
    assert sum(t.num_turns for t in trajectories) >= 10  # several episodes went past their first turn

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    retokenised_differently = 0
    for trajectory in trajectories:
        ids = trajectory.input_ids
        for (
            start,
            stop,
        ) in trajectory.turn_spans:  # each turn: exactly the ids sampled after exactly its context
            answers = sampled[tuple(ids[:start].tolist())]  # a group's episodes share their first context
            matching = [a for a in answers if a[0][: stop - start] == ids[start:stop].tolist()]
            assert matching, f"turn {ids[start:stop].tolist()} is none of the answers sampled: {answers}"
            turn_ids, turn_log_probs = matching[0]
            torch.testing.assert_close(trajectory.log_probs[start:stop], turn_log_probs[: stop - start])
            text = tokenizer.decode(turn_ids[: stop - start])
            retokenised_differently += (
                tokenizer(text, add_special_tokens=False)["input_ids"] != turn_ids[: stop - start]
            )
        with torch.no_grad():
            logits = model(input_ids=ids[None]).logits[0, :-1].float() / TEMPERATURE
        forward = torch.log_softmax(logits, dim=-1).gather(-1, ids[1:, None]).squeeze(-1)
        mask = trajectory.loss_mask[1:]
        torch.testing.assert_close(forward[mask], trajectory.log_probs[1:][mask], atol=1e-5, rtol=0)
        assert int(trajectory.loss_mask.sum()) == sum(stop - start for start, stop in trajectory.turn_spans)
    # The case that catches re-tokenisation: turns whose text encodes to other ids than were sampled.
    assert retokenised_differently >= 3


def test_observations_are_the_chat_templates_rendering_and_the_batch_carries_the_rewards(
    model_dir, tokenizer
):
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    rollout = create_rollout("hf", model_path=str(model_dir))
    sampling = SamplingConfig(
        n=3, temperature=TEMPERATURE, max_new_tokens=16, seed=1, stop_token_ids=(im_end,)
    )
    trajectories = run_episodes(
        rollout, tokenizer, EchoEnvironment, [{"prompt": QUESTIONS[0]}], sampling, TurnLimits(max_turns=3)
    )
    compared = 0
    for trajectory in trajectories:
        messages = [{"role": "user", "content": QUESTIONS[0]}]
        for k, turn in enumerate(trajectory.model_turns()):
            messages.append({"role": "assistant", "content": tokenizer.decode(turn[:-1])})
            messages.append({"role": "user", "content": f"turn {k} is over; hello again"})
        if trajectory.stop_reason in ("done", "max_turns"):  # the last turn ended with <|im_end|>
            rendered = tokenizer.apply_chat_template(
                messages[:-1], tools=[tool_schema(lookup)], tokenize=False
            )
            assert tokenizer.decode(trajectory.input_ids) + "\n" == rendered
            compared += trajectory.num_turns > 1
            assert trajectory.turn_rewards == tuple(k / 4 for k in range(trajectory.num_turns))
    assert compared >= 1, [(t.stop_reason, t.num_turns) for t in trajectories]
    batch = trajectory_batch(trajectories)
    assert batch["input_ids"].offsets().diff().tolist() == [len(t.input_ids) for t in trajectories]
    token_rewards = batch["token_rewards"].unbind()
    for trajectory, rewards in zip(trajectories, token_rewards, strict=True):
        ends = [stop - 1 for _, stop in trajectory.turn_spans]
        assert (
            rewards[ends].tolist() == list(trajectory.turn_rewards)
            and float(rewards.sum()) == trajectory.reward
        )
    assert batch["rewards"].tolist() == [t.reward for t in trajectories]
    assert batch["num_turns"].tolist() == [t.num_turns for t in trajectories]
    assert torch.equal(batch["loss_mask"].values(), torch.cat([t.loss_mask for t in trajectories]))
    assert (batch["token_versions"].values() == 0).all()

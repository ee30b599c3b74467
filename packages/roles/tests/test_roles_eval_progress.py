"""Held-out generation shows its progress: new tokens of the greedy batch out of ``max_new_tokens``, on the output
rank's terminal only, and not when ``trainer.progress_bar`` is off."""

from __future__ import annotations

import io
import re
import sys

import pytest
import torch
from drivetrain_roles.jobs import progress
from drivetrain_roles.jobs.default_assets import write_model_dir
from drivetrain_roles.jobs.evaluate import generate_answers


class Terminal(io.StringIO):
    """A stderr that says it is a terminal."""

    def isatty(self) -> bool:
        return True


WHERE_SHOWN = pytest.mark.parametrize(
    ("stderr", "enabled", "rank", "shown"),
    [
        (Terminal, True, 0, True),
        (io.StringIO, True, 0, False),
        (Terminal, False, 0, False),
        (Terminal, True, 1, False),
    ],
)
"""Where the bar is drawn: with progress on, on rank 0's stderr when it is a terminal; not on a file, not with
progress off, not on another rank."""


def on_stderr_of_rank(monkeypatch: pytest.MonkeyPatch, stderr: type[io.StringIO], rank: int) -> None:
    """Make a new ``stderr()`` this process's stderr and ``rank`` its rank, as the bar sees them."""
    monkeypatch.setattr(sys, "stderr", stderr())
    monkeypatch.setattr(progress.distributed, "rank", lambda: rank)


def _counts(output: str) -> list[tuple[int, int]]:
    """The bar's (count, total) each time it was drawn, repeats left out."""
    drawn = re.findall(r"evaluation: generating:\s+\d+%\|[^|]*\| (\d+)/(\d+)", output)
    return list(dict.fromkeys((int(count), int(total)) for count, total in drawn))


@pytest.fixture(scope="module")
def model_and_tokenizer(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = write_model_dir(tmp_path_factory.mktemp("model") / "m", seed=3)
    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


@WHERE_SHOWN
def test_generation_counts_its_new_tokens_on_the_output_ranks_terminal(
    model_and_tokenizer, arithmetic_prompts, monkeypatch, stderr, enabled, rank, shown
) -> None:
    model, tokenizer = model_and_tokenizer
    examples = arithmetic_prompts(tokenizer, 12)
    on_stderr_of_rank(monkeypatch, stderr, rank)
    answers = generate_answers(model, examples, tokenizer, max_new_tokens=7, progress=enabled)
    output = sys.stderr.getvalue()
    if not shown:
        assert output == ""
        return
    # The reference: the same greedy batch without the bar; its new columns are the tokens generated.
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert generate_answers(model, examples, tokenizer, max_new_tokens=7) == answers
    width = max(len(e.prompt_ids) for e in examples)
    generated = _new_tokens(model, tokenizer, examples, width)
    counts = _counts(output)
    assert counts[-1] == (generated, 7) and counts[0] == (0, 7)


def _new_tokens(model, tokenizer, examples, width) -> int:
    """How many tokens ``generate`` adds to the left-padded batch (plain transformers, no bar)."""
    from drivetrain_roles.jobs.stop_tokens import stop_token_ids

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids = torch.full((len(examples), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, e in enumerate(examples):
        ids[row, width - len(e.prompt_ids) :] = torch.tensor(e.prompt_ids)
        mask[row, width - len(e.prompt_ids) :] = 1
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=7,
        do_sample=False,
        pad_token_id=pad,
        eos_token_id=stop_token_ids(tokenizer) or None,
    )
    return out.shape[1] - width


GRPO_EVAL = ("rollout.max_new_tokens=40", "rollout.n=2", "trainer.prompts_per_step=4")
"""Greedy answers of at most 40 tokens, in slices of a training step's rows: 4 prompts x 2 responses."""


def answer(context: str) -> str:
    """The scripted rollout's answer: longer for longer prompts (every slice counts differently)."""
    return "the answer is " + "1" * (len(context) % 7)


@WHERE_SHOWN
def test_grpo_and_ppo_held_out_answers_count_their_tokens_slice_by_slice(
    tool_tokenizer, arithmetic_prompts, scripted_rollout, monkeypatch, stderr, enabled, rank, shown
) -> None:
    from drivetrain_engine_core.testing.tokenizer import IM_END
    from drivetrain_roles.grpo.config import load_config
    from drivetrain_roles.rl.held_out import greedy_answers
    from drivetrain_roles.rl.pipeline import RolloutPipeline

    config = load_config(None, [*GRPO_EVAL, f"trainer.progress_bar={str(enabled).lower()}"])
    examples = arithmetic_prompts(tool_tokenizer, 12)
    rollout = scripted_rollout(tool_tokenizer, answer)
    pipeline = RolloutPipeline(rollout, None, version=0, first=0, last=1, lag=None)  # type: ignore[arg-type]
    on_stderr_of_rank(monkeypatch, stderr, rank)
    output, trajectories = greedy_answers(examples, pipeline, config)
    assert trajectories is None and len(output.responses) == 12
    if not shown:
        assert sys.stderr.getvalue() == ""
        return
    # The reference: each answer's tokens, written out from the script; two calls, of 8 prompts and of 4.
    tokens = [
        len(
            tool_tokenizer(answer(tool_tokenizer.decode(e.prompt_ids)) + IM_END, add_special_tokens=False)[
                "input_ids"
            ]
        )
        for e in examples
    ]
    assert [len(r) for r in output.responses] == tokens
    assert _counts(sys.stderr.getvalue()) == [
        (0, 12 * 40),
        (sum(tokens[:8]), 12 * 40),
        (sum(tokens), 12 * 40),
    ]


def test_held_out_episodes_count_their_model_tokens_turn_by_turn(
    tool_tokenizer, scripted_rollout, monkeypatch
):
    from drivetrain_engine_core.testing.tokenizer import IM_END
    from drivetrain_roles.grpo.config import load_config
    from drivetrain_roles.jobs.data import Example
    from drivetrain_roles.rl.episodes import EpisodePipeline
    from drivetrain_roles.rl.held_out import greedy_answers

    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>'
    questions = ["12*34", "5+6", "7*8*9"]

    def play(context: str) -> str:
        expression = re.search(r"What is (\S+)\?", context).group(1)
        return call % expression if "<tool_response>" not in context else str(eval(expression))

    config = load_config(None, [*GRPO_EVAL, "environment.name=calculator", "environment.max_turns=3"])
    pipeline = EpisodePipeline.configured(
        config.environment,
        scripted_rollout(tool_tokenizer, play),
        None,  # type: ignore[arg-type]
        rows=lambda step: [],
        tokenizer=tool_tokenizer,
        version=0,
        first=0,
        last=1,
        lag=None,
    )
    examples = [
        Example(
            prompt_ids=[1],
            response_ids=[],
            prompt_text=q,
            response_text=str(eval(q)),
            columns={"messages": [{"role": "user", "content": f"What is {q}?"}], "answer": str(eval(q))},
        )
        for q in questions
    ]
    monkeypatch.setattr(sys, "stderr", Terminal())
    _, trajectories = greedy_answers(examples, pipeline, config)
    assert [t.stop_reason for t in trajectories] == ["done"] * 3

    # The reference: each turn's tokens, written out from the script (a call, then the value).
    def length(text: str) -> int:
        return len(tool_tokenizer(text + IM_END, add_special_tokens=False)["input_ids"])

    first = sum(length(call % q) for q in questions)
    second = sum(length(str(eval(q))) for q in questions)
    assert _counts(sys.stderr.getvalue()) == [(0, 3 * 3 * 40), (first, 360), (first + second, 360)]

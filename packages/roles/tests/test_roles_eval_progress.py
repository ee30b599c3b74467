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


@pytest.fixture(scope="module")
def model_and_tokenizer(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = write_model_dir(tmp_path_factory.mktemp("model") / "m", seed=3)
    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


@pytest.mark.parametrize(
    ("stderr", "enabled", "rank", "shown"),
    [
        (Terminal, True, 0, True),
        (io.StringIO, True, 0, False),
        (Terminal, False, 0, False),
        (Terminal, True, 1, False),
    ],
)
def test_generation_counts_its_new_tokens_on_the_output_ranks_terminal(
    model_and_tokenizer, arithmetic_prompts, monkeypatch, stderr, enabled, rank, shown
) -> None:
    model, tokenizer = model_and_tokenizer
    examples = arithmetic_prompts(tokenizer, 12)
    monkeypatch.setattr(sys, "stderr", stderr())
    monkeypatch.setattr(progress.distributed, "rank", lambda: rank)
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
    counts = re.findall(r"evaluation: generating:\s+\d+%\|[^|]*\| (\d+)/(\d+)", output)
    assert counts[-1] == (str(generated), "7") and counts[0] == ("0", "7")


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

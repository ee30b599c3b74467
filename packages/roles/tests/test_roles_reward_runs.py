"""Prompt-only rows (``data.response_key=null``): the prompt alone, as the policy will see it, with the row's
columns and where it is; SFT, which trains on responses, refuses the setting."""

from __future__ import annotations

import pytest
from drivetrain_engine_core.config import ConfigError
from drivetrain_roles.command_sections import DataConfig
from drivetrain_roles.jobs.data import tokenize_row


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

"""SFT data loading: parquet and JSONL read the same, chat messages are masked to their assistant turns."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from drivetrain_engine_core.testing import build_tiny_tokenizer
from drivetrain_roles.jobs.batches import StepSampler, make_sft_batch
from drivetrain_roles.jobs.data import DataError, load_examples, read_rows, tokenize_prompt_response
from drivetrain_roles.jobs.default_assets import build_arithmetic_tokenizer, write_model_dir
from drivetrain_roles.sft.config import DataConfig, load_config

ROWS = [{"prompt": "hello ", "response": "world"}, {"prompt": "the answer is ", "response": "42"}]


def test_jsonl_strings_may_hold_unicode_line_separators(tmp_path) -> None:
    """JSON allows U+2028, U+2029 and U+0085 raw inside strings (``ensure_ascii=False`` writes them so); the
    reader split lines at them too and refused valid files ("Unterminated string")."""
    rows = [{"prompt": "a\u2028b\u2029c\x85 ", "response": "world"}, *ROWS]
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("".join(json.dumps(r, ensure_ascii=False) + "\r\n" for r in rows), encoding="utf-8")
    parquet = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    assert read_rows(jsonl) == read_rows(parquet) == rows


def test_parquet_and_jsonl_give_the_same_examples_with_response_only_loss(tmp_path) -> None:
    tokenizer = build_tiny_tokenizer()
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    parquet = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), parquet)
    config = DataConfig(train_files=(str(jsonl),))
    from_jsonl = load_examples([jsonl], tokenizer, config)
    assert from_jsonl == load_examples([parquet], tokenizer, config)
    first = from_jsonl[0]
    # The prompt is what ``tokenizer(prompt)`` gives: this tokenizer has a BOS but never adds it (GPT-2 style),
    # and a BOS was prepended anyway.
    assert (
        first.prompt_ids
        == tokenizer("hello ")["input_ids"]
        == tokenizer.encode("hello ", add_special_tokens=False)
    )
    # An empty prompt keeps a BOS: the first response token needs a token before it to be scored.
    empty = tokenize_prompt_response("", "world", tokenizer, where="row 0", columns=("prompt", "response"))
    assert empty.prompt_ids == [tokenizer.bos_token_id]
    assert first.response_ids == [
        *tokenizer.encode("world", add_special_tokens=False),
        tokenizer.eos_token_id,
    ]
    batch = make_sft_batch(from_jsonl)
    mask = batch["loss_mask"].values().tolist()
    assert mask[: first.length] == [False] * len(first.prompt_ids) + [True] * len(first.response_ids)


def test_a_tokenizer_that_adds_a_bos_keeps_it_in_the_prompt() -> None:
    from drivetrain_roles.jobs.default_assets import build_arithmetic_tokenizer

    tokenizer = build_arithmetic_tokenizer()
    example = tokenize_prompt_response("1+2=", "3", tokenizer, where="row 0", columns=("prompt", "response"))
    assert example.prompt_ids == [tokenizer.bos_token_id, *tokenizer.encode("1+2=", add_special_tokens=False)]


def test_a_rendered_bos_and_eos_are_not_doubled() -> None:
    """A prompt already rendered with its BOS (a chat template's text) got a second BOS from ``tokenizer``, and
    a response already ending with the EOS got a second EOS: training on ``<s><s>`` and on ``</s></s>``, which
    the model then learnt to produce. TRL appends the EOS only when missing."""
    tokenizer = build_arithmetic_tokenizer()
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    plain = tokenize_prompt_response("1+2=", "3", tokenizer, where="row", columns=("p", "r"))
    rendered = tokenize_prompt_response("<s>1+2=", "3</s>", tokenizer, where="row", columns=("p", "r"))
    assert rendered.prompt_ids == plain.prompt_ids and rendered.prompt_ids[:2] == [bos, plain.prompt_ids[1]]
    assert rendered.response_ids == plain.response_ids and rendered.response_ids[-2:] != [eos, eos]


def test_a_sequences_first_token_is_never_a_loss_token() -> None:
    """With an empty prompt and a tokenizer without BOS (Qwen) the first response token opened the sequence:
    nothing precedes it, so it was never trained, yet it counted in the token mean and diluted the loss."""
    from drivetrain_roles.jobs.data import Example

    batch = make_sft_batch(
        [
            Example(prompt_ids=[], response_ids=[5, 6, 2], prompt_text="", response_text="ab"),
            Example(prompt_ids=[1], response_ids=[5, 2], prompt_text="", response_text="a"),
        ]
    )
    assert [m.tolist() for m in batch["loss_mask"].unbind()] == [[False, True, True], [False, True, True]]


CONVERSATION = [
    {"role": "user", "content": "hello"},
    {"role": "assistant", "content": "world"},
    {"role": "user", "content": "the answer"},
    {"role": "assistant", "content": "is 42"},
]


def _chat_example(tmp_path, tokenizer, **data):
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": CONVERSATION}) + "\n")
    config = DataConfig(train_files=(str(path),), messages_key="messages", max_length=256, **data)
    (example,) = load_examples([path], tokenizer, config)
    return example


def _trained_text(tokenizer, example) -> str:
    (ids,) = make_sft_batch([example])["input_ids"].unbind()
    (mask,) = make_sft_batch([example])["loss_mask"].unbind()
    return tokenizer.decode(ids[mask].tolist())


def test_chat_messages_train_on_every_assistant_turn(tmp_path) -> None:
    """verl's multi-turn SFT dataset and TRL's ``assistant_only_loss`` train every assistant turn; only the last
    one was trained. The loss tokens are each assistant turn's content and end-of-turn, written out here from
    the ChatML template, and nothing of the user turns."""
    tokenizer = build_tiny_tokenizer()
    example = _chat_example(tmp_path, tokenizer)
    assert (
        tokenizer.decode(example.prompt_ids + example.response_ids)
        == tokenizer.apply_chat_template(CONVERSATION, tokenize=False) + tokenizer.eos_token
    )
    assert tokenizer.decode(example.response_ids) == "is 42<|im_end|>\n</s>"
    assert tokenizer.decode(example.prompt_ids).endswith("<|im_start|>assistant\n")
    assert _trained_text(tokenizer, example) == "world<|im_end|>\nis 42<|im_end|>\n</s>"


def test_chat_messages_can_train_on_the_last_assistant_turn_only(tmp_path) -> None:
    tokenizer = build_tiny_tokenizer()
    example = _chat_example(tmp_path, tokenizer, assistant_turns="last")
    assert example.earlier_turn_spans == ()
    assert _trained_text(tokenizer, example) == "is 42<|im_end|>\n</s>"


def test_a_template_that_rewrites_earlier_turns_names_the_way_out(tmp_path) -> None:
    """Qwen3's template drops the reasoning of earlier assistant turns, so a turn renders differently once later
    turns follow it and its tokens are not in the conversation: refused with the options, not trained off-place."""
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] == 'assistant' and not loop.last %}...{% else %}{{ m['content'] }}{% endif %}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    with pytest.raises(DataError, match=r"assistant turn 1 .*data.assistant_turns=last"):
        _chat_example(tmp_path, tokenizer)
    assert _trained_text(tokenizer, _chat_example(tmp_path, tokenizer, assistant_turns="last")) == (
        "is 42<|im_end|>\n</s>"
    )


def test_prompt_response_columns_can_be_rendered_with_the_chat_template(tmp_path) -> None:
    """verl's SFT dataset and RL prompts render a prompt column with the chat template; its parquet files used
    on an instruct model trained without the chat format. ``data.apply_chat_template`` renders each row as a
    user turn and an assistant turn, exactly as the same conversation in a messages column."""
    from drivetrain_engine_core.backend import ConfigError

    tokenizer = build_tiny_tokenizer()
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"prompt": "hello", "response": "world"}) + "\n")
    chat = tmp_path / "chat.jsonl"
    conversation = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "world"}]
    chat.write_text(json.dumps({"messages": conversation}) + "\n")
    (rendered,) = load_examples([path], tokenizer, DataConfig(apply_chat_template=True, max_length=256))
    (expected,) = load_examples([chat], tokenizer, DataConfig(messages_key="messages", max_length=256))
    assert rendered == expected
    assert tokenizer.decode(rendered.prompt_ids).endswith("<|im_start|>assistant\n")
    with pytest.raises(ConfigError, match="set one of them"):
        DataConfig(apply_chat_template=True, messages_key="messages")


def test_chat_messages_must_end_with_the_assistant(tmp_path) -> None:
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hello"}]}) + "\n")
    with pytest.raises(DataError, match="ending with an assistant turn"):
        load_examples([path], build_tiny_tokenizer(), DataConfig(messages_key="messages"))


def test_step_order_depends_on_seed_and_step_only_and_ranks_split_it() -> None:
    sampler = StepSampler(num_examples=10, batch_size=4, seed=7)
    assert sampler.steps_per_epoch == 2
    step3 = sampler.global_indices(3).tolist()
    assert step3 == StepSampler(num_examples=10, batch_size=4, seed=7).global_indices(3).tolist()
    assert len(set(sampler.global_indices(0).tolist() + sampler.global_indices(1).tolist())) == 8
    assert sampler.local_indices(3, 0, 2) + sampler.local_indices(3, 1, 2) == step3[0::2] + step3[1::2]


def test_a_resolved_config_file_keeps_the_schedule_following_the_run(tmp_path) -> None:
    """``--print-config`` output and a run's config.yaml used to hold a copy of the run length in the LR
    schedule, so ``trainer.total_steps=400`` on top of one left the cosine schedule at the old length (then an
    echo heuristic guessed which file values were copies). The schedule now holds ``null`` and reads the run's
    length when the engine is made; a length the user sets stays."""
    from drivetrain_roles.runtime.command_config import to_yaml

    resolved = tmp_path / "resolved.yaml"
    resolved.write_text(to_yaml(load_config(None, ["trainer.total_steps=50"])))
    assert yaml.safe_load(resolved.read_text())["optimizer"]["total_steps"] is None
    assert load_config(resolved) == load_config(None, ["trainer.total_steps=50"])  # re-runs as it was
    longer = load_config(resolved, ["trainer.total_steps=400"]).run_optimizer()
    assert (longer.total_steps, longer.warmup_steps) == (400, 10)
    assert longer == load_config(None, ["trainer.total_steps=400"]).run_optimizer()
    pinned = tmp_path / "pinned.yaml"
    pinned.write_text(to_yaml(load_config(None, ["trainer.total_steps=50", "optimizer.total_steps=30"])))
    assert load_config(pinned, ["trainer.total_steps=400"]).run_optimizer().total_steps == 30


def test_a_pinned_cpu_device_beside_a_gpu_is_warned_about(monkeypatch, caplog) -> None:
    """A config printed on a machine without a GPU holds ``engine.device: cpu``; read on a GPU node it kept
    the engine on the CPU without a word."""
    from drivetrain_roles.runtime.command_config import build

    monkeypatch.setattr(build, "machine_device", lambda: "cuda")
    with caplog.at_level("WARNING"):
        assert load_config(None, []).engine.device == "cuda"
        assert not caplog.text
        assert load_config(None, ["engine.device=cpu"]).engine.device == "cpu"
    assert "engine.device=cpu is set" in caplog.text and "Drop engine.device to use the GPU" in caplog.text


def test_a_model_directory_without_tokenizer_files_is_refused(tmp_path) -> None:
    """transformers 5 loads an empty tokenizer from a directory without tokenizer files: every example became
    the bare EOS and a run "trained" with loss 0, then saved that tokenizer with the model."""
    from drivetrain_engine_core.testing import make_tiny_model_dir
    from drivetrain_roles.jobs.assets import ModelPathError, load_tokenizer

    bare = make_tiny_model_dir(tmp_path / "bare", arch="qwen2", with_tokenizer=False)
    with pytest.raises(
        ModelPathError, match=r"knows 1 token\(s\) and encodes no text: .* no tokenizer files"
    ):
        load_tokenizer(str(bare))
    assert load_tokenizer(str(make_tiny_model_dir(tmp_path / "full", arch="qwen2")))("a b")["input_ids"]
    assert load_tokenizer(str(write_model_dir(tmp_path / "arithmetic", seed=0)))("1+2=")["input_ids"]


def test_none_unsets_an_optional_field_as_its_help_says() -> None:
    """The fields' help says "``None`` disables clipping" and TRL users type None; it was refused with "write
    a number", and ``model.lora=None`` failed with an OmegaConf merge error."""
    from drivetrain_engine_core.backend import ConfigError

    config = load_config(None, ["optimizer.clip_grad=None", "model.lora=None", "trainer.cpu_threads=null"])
    assert (
        config.optimizer.clip_grad is None
        and config.model.lora is None
        and config.trainer.cpu_threads is None
    )
    with pytest.raises(
        ConfigError, match=r"write a number, e.g. optimizer.clip_grad=0.5, or null to unset it"
    ):
        load_config(None, ["optimizer.clip_grad=abc"])


def test_overrides_parse_numbers_and_micro_batch_limits_exclude_each_other() -> None:
    config = load_config(
        None, ["optimizer.lr=5e-3", "engine.micro_batch.micro_batch_size=4", "data.train_files=[a.jsonl]"]
    )
    assert config.optimizer.lr == 0.005
    assert (config.engine.micro_batch.micro_batch_size, config.engine.micro_batch.max_tokens) == (4, None)
    assert config.data.train_files == ("a.jsonl",)
    assert config.run_optimizer().total_steps == config.trainer.total_steps


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"prompt": null, "response": "2"}\n', r"row 0 column 'prompt' holds NoneType 'None', not text"),
        (
            '{"prompt": "1+1=", "response": ["2"]}\n',
            r"row 0 column 'response' holds list \"\['2'\]\", not text",
        ),
        ('{"prompt": "1+1=", "response": "2"}\n[1, 2]\n', r"d\.jsonl:2 is a JSON list, not an object"),
        ('"just text"\n', r"d\.jsonl:1 is a JSON str, not an object"),
        (
            b'{"prompt": "caf\xe9", "response": "2"}\n',
            r"d\.jsonl is not UTF-8 \(byte 15 is b'\\xe9'\).*iconv",
        ),
    ],
    ids=["none_value", "list_value", "array_line", "string_line", "latin1"],
)
def test_unusable_rows_are_one_clear_error(tmp_path, content, message) -> None:
    path = tmp_path / "d.jsonl"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(DataError, match=message):
        load_examples([path], build_tiny_tokenizer(), DataConfig(train_files=(str(path),)))


def test_corrupt_parquet_is_one_clear_error(tmp_path) -> None:
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path)
    path.write_bytes(path.read_bytes()[:40])
    with pytest.raises(DataError, match=r"d\.parquet is not a readable parquet file .*re-export"):
        load_examples([path], build_tiny_tokenizer(), DataConfig(train_files=(str(path),)))


def test_overlong_examples_are_refused_or_dropped_as_data_overlong_says(tmp_path, caplog) -> None:
    """Over-long examples were always an error; ``data.overlong=drop`` skips them (OpenRLHF filters them) with one
    warning counting them, and refuses a data set that it would leave empty."""
    tokenizer = build_tiny_tokenizer()
    rows = [
        {"prompt": "hi ", "response": "ok"},
        {"prompt": "hello there ", "response": "a long answer"},
        *ROWS,
    ]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    lengths = [load_examples([path], tokenizer, DataConfig(max_length=999))[i].length for i in range(4)]
    budget = sorted(lengths)[1]  # two rows fit, two do not
    with pytest.raises(DataError, match=rf"row {lengths.index(max(lengths))} has .*set data.overlong=drop"):
        load_examples([path], tokenizer, DataConfig(max_length=budget))
    kept = load_examples([path], tokenizer, DataConfig(max_length=budget, overlong="drop"))
    assert [e.length for e in kept] == [n for n in lengths if n <= budget]
    assert f"2 of 4 examples of ['{path}'] are longer than data.max_length={budget} tokens" in caplog.text
    assert f"(the longest has {max(lengths)}); data.overlong=drop skips them" in caplog.text
    with pytest.raises(
        DataError, match=r"4 of 4 examples .* data.overlong=drop leaves none. Raise data.max_length"
    ):
        load_examples([path], tokenizer, DataConfig(max_length=2, overlong="drop"))


def _reloaded_arithmetic_tokenizer(tmp_path):
    from drivetrain_roles.jobs.default_assets import write_model_dir
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(write_model_dir(tmp_path / "model"))


@pytest.mark.parametrize("reloaded", [False, True])
def test_characters_the_tokenizer_does_not_know_are_refused(tmp_path, reloaded) -> None:
    """The built tokenizer maps unknown characters to ``<pad>``. Reloaded with ``AutoTokenizer`` (what every run
    does), it is transformers' ``Qwen2Tokenizer`` (its model type's class): a BPE without an unknown token, which
    encodes ``"two"`` as nothing, so a user's data with the embedded model trained end-of-sequence alone."""
    tokenizer = _reloaded_arithmetic_tokenizer(tmp_path) if reloaded else build_arithmetic_tokenizer()
    if reloaded:
        assert tokenizer.encode("two", add_special_tokens=False) == []  # what made the check miss them
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "1+1=", "response": "two"}) + "\n")
    with pytest.raises(
        DataError, match=r"row 0 column 'response' has characters the tokenizer does not know \('otw'\)"
    ):
        load_examples([path], tokenizer, DataConfig(train_files=(str(path),)))
    path.write_text(json.dumps({"prompt": "1+1=", "response": "2"}) + "\n")
    assert load_examples([path], tokenizer, DataConfig(train_files=(str(path),)))[0].response_text == "2"

"""Chat SFT learns to stop: on a base tokenizer whose ChatML turn end (``<|im_end|>``) is not its EOS (``</s>``),
each example ends with the turn end and the EOS, and the exported model's ``generate`` stops at the turn end."""

from __future__ import annotations

import json
import math

import pytest
from drivetrain_engine_core.testing import build_tiny_tokenizer
from drivetrain_engine_core.testing.models import make_tiny_model_dir
from drivetrain_roles.jobs.batches import make_sft_batch
from drivetrain_roles.jobs.data import load_examples
from drivetrain_roles.sft.config import DataConfig, load_config
from drivetrain_roles.sft.trainer import SFTResult, SFTTrainer
from transformers import AutoModelForCausalLM, AutoTokenizer

IM_END, NEWLINE, EOS = 5, 101, 2
"""The tiny tokenizer's ``<|im_end|>``, ``"\\n"`` (spelt ``Ċ``, byte-level) and ``</s>``: ChatML closes a turn with ``<|im_end|>\\n``."""

SYSTEM = {"role": "system", "content": "be short"}


def conversation(index: int) -> list[dict[str, str]]:
    """A system prompt and two exchanges; the answers follow from the index, so a tiny model memorises them."""
    return [
        SYSTEM,
        {"role": "user", "content": f"hello {index}"},
        {"role": "assistant", "content": f"world {index}"},
        {"role": "user", "content": "the answer?"},
        {"role": "assistant", "content": f"is {7 * index}"},
    ]


def write_conversations(path, count: int):
    path.write_text("".join(json.dumps({"messages": conversation(i)}) + "\n" for i in range(count)))
    return path


def test_a_chat_example_trains_on_each_turn_end_and_ends_with_the_eos(tmp_path) -> None:
    """The response was the template's tokens after the prompt, ``is 42<|im_end|>\\n`` with no ``</s>``: a model
    trained on it never learnt to stop once the tokenizer's EOS is not the turn end. The loss tokens are each
    assistant turn with its turn end, and the last one's EOS: ids written out here."""
    tokenizer = build_tiny_tokenizer()
    assert (tokenizer.convert_tokens_to_ids(["<|im_end|>", "Ċ"]), tokenizer.eos_token_id) == (
        [IM_END, NEWLINE],
        EOS,
    )
    path = write_conversations(tmp_path / "chat.jsonl", 7)
    config = DataConfig(train_files=(str(path),), messages_key="messages", max_length=256)
    example = load_examples([path], tokenizer, config)[6]
    batch = make_sft_batch([example])
    (ids,) = batch["input_ids"].unbind()
    (mask,) = batch["loss_mask"].unbind()
    earlier = [*tokenizer.encode("world 6", add_special_tokens=False), IM_END, NEWLINE]
    last = [*tokenizer.encode("is 42", add_special_tokens=False), IM_END, NEWLINE, EOS]
    assert ids[mask].tolist() == earlier + last
    assert ids.tolist()[-4:] == [tokenizer.convert_tokens_to_ids("2"), IM_END, NEWLINE, EOS]
    assert ids.tolist().count(EOS) == 1  # earlier turns end with the turn end alone: the conversation goes on


def test_a_batch_of_chat_examples_keeps_each_conversations_tokens_and_turns(tmp_path) -> None:
    """A step's batch of conversations of different lengths (``batch_from_lists`` splits one flat tensor per
    field): each sequence holds its own example's ids, and its loss tokens are its two assistant turns with their
    turn ends and the final EOS, written out here per conversation."""
    tokenizer = build_tiny_tokenizer()
    path = write_conversations(tmp_path / "chat.jsonl", 7)
    config = DataConfig(train_files=(str(path),), messages_key="messages", max_length=256)
    examples = load_examples([path], tokenizer, config)
    batch = make_sft_batch(examples)
    lengths = [len(e.token_ids) for e in examples]
    assert len(set(lengths)) > 1  # "is 0" ... "is 42": the split must follow each sequence's own length
    for i, (example, ids, mask) in enumerate(
        zip(examples, batch["input_ids"].unbind(), batch["loss_mask"].unbind(), strict=True)
    ):
        earlier = [*tokenizer.encode(f"world {i}", add_special_tokens=False), IM_END, NEWLINE]
        last = [*tokenizer.encode(f"is {7 * i}", add_special_tokens=False), IM_END, NEWLINE, EOS]
        assert ids.tolist() == example.token_ids
        assert ids[mask].tolist() == earlier + last


def test_the_stop_tokens_are_the_eos_and_the_templates_turn_end() -> None:
    """The turn end is read off the template: ChatML's ``<|im_end|>``; a Llama 3-style ``<|eot_id|>``, an added
    special token the tokenizer names nowhere else, without the non-special ``<think>`` the assistant turn
    opens with; none beyond the EOS where the template ends a turn with it (Mistral) or there is no template."""
    from drivetrain_roles.jobs.default_assets import build_arithmetic_tokenizer
    from drivetrain_roles.jobs.stop_tokens import stop_token_ids
    from tokenizers import AddedToken

    chatml = build_tiny_tokenizer()
    assert stop_token_ids(chatml) == [EOS, IM_END]
    llama = build_tiny_tokenizer()
    llama.add_tokens([AddedToken(t, special=t != "<think>") for t in ("<|eot_id|>", "<|start|>", "<think>")])
    llama.chat_template = (
        "{% for m in messages %}<|start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}<think>{% endif %}"
        "{{ m['content'] }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}<|start|>assistant\n{% endif %}"
    )
    assert stop_token_ids(llama) == [EOS, llama.convert_tokens_to_ids("<|eot_id|>")] == [EOS, 110]
    mistral = build_tiny_tokenizer()
    mistral.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
        "{% else %}{{ m['content'] }}</s>{% endif %}{% endfor %}"
    )
    assert stop_token_ids(mistral) == stop_token_ids(build_arithmetic_tokenizer()) == [EOS]


MAX_NEW_TOKENS = 24
CONVERSATIONS = 8


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory):
    """80 steps on 8 conversations (a system prompt, two exchanges), held out on the same ones: memorised.

    NOTE: a Llama-type model directory, whose tokenizer reloads as itself; transformers 5 reloads the tiny
    tokenizer beside a Qwen2 config as ``Qwen2Tokenizer``, which drops spaces and newlines.
    """
    root = tmp_path_factory.mktemp("chat")
    model = make_tiny_model_dir(root / "model", arch="llama", hidden_size=64)
    data = write_conversations(root / "chat.jsonl", CONVERSATIONS)
    config = load_config(
        None,
        [
            f"model.path={model}",
            f"data.train_files=[{data}]",
            f"data.val_files=[{data}]",
            "data.messages_key=messages",
            "data.max_length=128",
            "trainer.total_steps=80",
            "trainer.batch_size=8",
            "trainer.eval_every=0",
            "trainer.save_every=0",
            f"trainer.eval_samples={CONVERSATIONS}",
            f"trainer.max_new_tokens={MAX_NEW_TOKENS}",
            "trainer.progress_bar=false",
            "optimizer.lr=1e-2",
        ],
    )
    trainer = SFTTrainer(config, root / "run")
    return trainer, trainer.run()


@pytest.mark.slow
def test_the_exported_model_stops_at_the_turn_end(chat_run) -> None:
    """Greedy answers ran to ``max_new_tokens``: the examples had no EOS and the exported generation config
    stopped at ``</s>`` only. The exported ``generation_config`` lists ``<|im_end|>`` beside ``</s>``: plain
    ``generate`` on the folder stops at the turn end with the reference answer, and a caller stopping at the
    tokenizer's EOS alone stops right after the turn end (``<|im_end|>\n</s>``)."""
    _, result = chat_run
    final = result.output_dir / "final_model"
    model, tokenizer = AutoModelForCausalLM.from_pretrained(final), AutoTokenizer.from_pretrained(final)
    correct = 0
    for index in range(CONVERSATIONS):
        prompt = tokenizer.apply_chat_template(
            conversation(index)[:-1], add_generation_prompt=True, return_dict=True, return_tensors="pt"
        )
        width = prompt["input_ids"].shape[1]
        answer = model.generate(**prompt)[0, width:].tolist()
        assert answer[-1] == IM_END and len(answer) < MAX_NEW_TOKENS
        correct += tokenizer.decode(answer, skip_special_tokens=True) == f"is {7 * index}"
        eos_only = model.generate(**prompt, eos_token_id=tokenizer.eos_token_id)[0, width:].tolist()
        assert eos_only == [*answer, NEWLINE, EOS]
    assert correct / CONVERSATIONS == result.evaluations[-1]["val/accuracy"] == 1.0
    assert model.generation_config.eos_token_id == [EOS, IM_END]


@pytest.mark.slow
def test_chat_runs_lead_with_the_held_out_loss_and_exact_answers_with_exact_match(chat_run, tmp_path) -> None:
    """Chat references are open-ended: the report and ``summary.json`` lead with the held-out loss (perplexity
    ``exp(loss)`` beside it); the embedded arithmetic keeps exact match as its headline."""
    from drivetrain_roles.sft.headline import perplexity

    trainer, result = chat_run
    last = result.evaluations[-1]
    assert last["val/perplexity"] == pytest.approx(math.exp(last["val/loss"]), rel=1e-12)
    # A summed loss per sequence has no perplexity; a diverged one reads inf, not an OverflowError.
    assert perplexity(2.0, "seq-mean-token-sum") == {}
    assert perplexity(1e4, "token-mean") == {"val/perplexity": math.inf}
    summary = json.loads((result.output_dir / "summary.json").read_text())
    assert summary["headline"]["metric"] == "val/loss" and summary["headline"]["value"] == last["val/loss"]
    lines = trainer.report(result).splitlines()
    assert lines[1].startswith("held-out headline: val/loss (chat data (data.messages_key=messages)")
    assert [line.split(":")[0] for line in lines[2:5]] == ["val/loss", "val/perplexity", "val/accuracy"]
    arithmetic = SFTTrainer(load_config(None, []), tmp_path)
    evaluations = [{"step": 0, "val/loss": 2.0, "val/perplexity": math.exp(2.0), "val/accuracy": 0.5}]
    lines = arithmetic.report(SFTResult(output_dir=tmp_path, evaluations=evaluations)).splitlines()
    assert lines[1].startswith("held-out headline: val/accuracy (prompt/response data has exact answers")
    assert [line.split(":")[0] for line in lines[2:5]] == ["val/accuracy", "val/loss", "val/perplexity"]
    assert arithmetic._summary(SFTResult(output_dir=tmp_path, evaluations=evaluations))["headline"] == {
        "metric": "val/accuracy",
        "value": 0.5,
        "reason": "prompt/response data has exact answers: exact match of greedy answers leads",
    }

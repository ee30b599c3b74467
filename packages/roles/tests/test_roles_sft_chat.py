"""Chat SFT learns to stop: on a base tokenizer whose ChatML turn end (``<|im_end|>``) is not its EOS (``</s>``),
each example ends with the turn end and the EOS, and the exported model's ``generate`` stops at the turn end."""

from __future__ import annotations

import json

from drivetrain_engine_core.testing import build_tiny_tokenizer
from drivetrain_roles.jobs.batches import make_sft_batch
from drivetrain_roles.jobs.data import load_examples
from drivetrain_roles.sft.config import DataConfig

IM_END, NEWLINE, EOS = 5, 101, 2
"""The tiny tokenizer's ``<|im_end|>``, ``"\\n"`` and ``</s>``: ChatML closes a turn with ``<|im_end|>\\n``."""

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
    assert (tokenizer.convert_tokens_to_ids(["<|im_end|>", "\n"]), tokenizer.eos_token_id) == (
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

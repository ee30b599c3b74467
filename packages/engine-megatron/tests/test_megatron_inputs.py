"""Model inputs of a micro-batch (no megatron groups needed): right-padded rows on the micro-batch's device."""

from __future__ import annotations

import torch
from drivetrain_engine_core.testing import random_batch
from drivetrain_engine_megatron.inputs import prepare_model_inputs

PROMPTS, RESPONSES = [3, 5, 2], [4, 2, 6]


def test_padded_rows_are_built_on_the_micro_batch_device():
    """Every tensor lives on the micro-batch's device, whatever the process's default device is.

    A GPU run keeps CPU as the default device while the micro-batch is on ``cuda``; here the default is
    ``meta`` and the micro-batch on CPU, which mismatches the same way (and fails) if anything is built on
    the default device. The values are checked against the layout written out by hand.
    """
    batch = random_batch(vocab_size=50, prompt_lengths=PROMPTS, response_lengths=RESPONSES, seed=0)
    with torch.device("meta"):
        inputs = prepare_model_inputs(batch, remove_padding=False, device="cpu")
    tensors = {
        "input_ids": inputs.input_ids,
        "position_ids": inputs.position_ids,
        "attention_mask": inputs.attention_mask,
        "valid": inputs.valid,
    }
    assert {name: tensor.device.type for name, tensor in tensors.items()} == dict.fromkeys(tensors, "cpu")
    lengths = [p + r for p, r in zip(PROMPTS, RESPONSES, strict=True)]
    width = max(lengths)
    sequences = batch["input_ids"].values().split(lengths)
    expected_ids = torch.stack([torch.nn.functional.pad(ids, (0, width - len(ids))) for ids in sequences])
    key = torch.arange(width)
    expected_valid = key[None, :] < torch.tensor(lengths)[:, None]
    allowed = (key[None, :] <= key[:, None])[None] & expected_valid[:, None, :]
    assert torch.equal(inputs.input_ids, expected_ids)
    assert torch.equal(inputs.position_ids, key.expand(len(lengths), width))
    assert torch.equal(inputs.valid, expected_valid)
    assert torch.equal(inputs.attention_mask, ~allowed[:, None])

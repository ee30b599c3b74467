"""Model inputs of a micro-batch (no megatron groups needed): right-padded rows on the micro-batch's device."""

from __future__ import annotations

import torch
from drivetrain_engine_core.backend import ForwardOptions, MicroBatch, RoundTrip
from drivetrain_engine_core.job import LossContext
from drivetrain_engine_core.testing import random_batch
from drivetrain_engine_megatron.inputs import model_kwargs

PROMPTS, RESPONSES = [3, 5, 2], [4, 2, 6]


def test_padded_rows_are_built_on_the_micro_batch_device():
    """Every tensor lives on the micro-batch's device, whatever the process's default device is.

    A GPU run keeps CPU as the default device while the micro-batch is on ``cuda``; here the default is
    ``meta`` and the micro-batch on CPU, which mismatches the same way (and fails) if anything is built on
    the default device. The values are checked against the layout written out by hand.
    """
    batch = random_batch(vocab_size=50, prompt_lengths=PROMPTS, response_lengths=RESPONSES, seed=0)
    trip = RoundTrip(
        loss_fn=None,
        options=ForwardOptions(),
        context=LossContext(global_token_count=0, global_sequence_count=3),
        gradient_divisor=1,
        keep_outputs=True,
    )
    with torch.device("meta"):
        micro_batch = MicroBatch.build(batch, 0, device="cpu", layout="padded", round_trip=trip)
        kwargs = model_kwargs(micro_batch)
    valid = micro_batch.inputs.valid  # type: ignore[union-attr]
    tensors = {name: kwargs[name] for name in ("input_ids", "position_ids", "attention_mask")}
    assert {name: t.device.type for name, t in {**tensors, "valid": valid}.items()} == dict.fromkeys(
        [*tensors, "valid"], "cpu"
    )
    lengths = [p + r for p, r in zip(PROMPTS, RESPONSES, strict=True)]
    width = max(lengths)
    sequences = batch["input_ids"].values().split(lengths)
    expected_ids = torch.stack([torch.nn.functional.pad(ids, (0, width - len(ids))) for ids in sequences])
    key = torch.arange(width)
    expected_valid = key[None, :] < torch.tensor(lengths)[:, None]
    allowed = (key[None, :] <= key[:, None])[None] & expected_valid[:, None, :]
    assert torch.equal(tensors["input_ids"], expected_ids)
    assert torch.equal(tensors["position_ids"], torch.where(expected_valid, key, 0))
    assert torch.equal(valid, expected_valid)
    assert torch.equal(tensors["attention_mask"], ~allowed[:, None])

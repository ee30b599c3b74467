"""Core's router replay pieces without a model: the record laid out like a micro-batch's ``input_ids`` (packed
row, padded rows), and the refusal of a backend that does not replay."""

from __future__ import annotations

import pytest
import torch
from drivetrain_engine_core.backend import BatchError, ForwardOptions, MicroBatch, RoundTrip
from drivetrain_engine_core.job import LossContext, make_batch
from drivetrain_engine_core.kit import NOT_RECORDED, ROUTED_EXPERTS, micro_batch_routes, refuse_routes

TRIP = RoundTrip(
    loss_fn=None,
    options=ForwardOptions(),
    context=LossContext(global_token_count=0, global_sequence_count=2),
    gradient_divisor=1,
    keep_outputs=True,
)


def routed_batch():
    """Two sequences of 3 and 2 tokens; token ``t`` of sequence ``s`` routes to ``10 * s + t`` in each of 2
    layers x top-1."""
    routes = [
        torch.arange(3).view(3, 1, 1).expand(3, 2, 1),
        (10 + torch.arange(2)).view(2, 1, 1).expand(2, 2, 1),
    ]
    ids = [torch.tensor([5, 6, 7]), torch.tensor([8, 9])]
    return make_batch(ids, **{ROUTED_EXPERTS: [r.to(torch.int16) for r in routes]})


def test_routes_follow_the_packed_row_and_the_padded_rows():
    packed = MicroBatch.build(routed_batch(), 0, device="cpu", layout="packed", round_trip=TRIP)
    assert micro_batch_routes(packed)[:, 0, 0].tolist() == [0, 1, 2, 10, 11]
    padded = MicroBatch.build(routed_batch(), 0, device="cpu", layout="padded", round_trip=TRIP)
    # Rows of width 3, row-major: the second sequence's padding position is not recorded (routed live).
    assert micro_batch_routes(padded)[:, 1, 0].tolist() == [0, 1, 2, 10, 11, NOT_RECORDED]
    plain = MicroBatch.build(
        make_batch([torch.tensor([5, 6])]), 0, device="cpu", layout="packed", round_trip=TRIP
    )
    assert micro_batch_routes(plain) is None


def test_a_backend_that_does_not_replay_refuses_recorded_routes():
    micro_batch = MicroBatch.build(routed_batch(), 0, device="cpu", layout="packed", round_trip=TRIP)
    with pytest.raises(BatchError, match=r"which the toy engine does not replay; set rollout.router_replay"):
        refuse_routes([micro_batch], "toy")
    refuse_routes(
        [
            MicroBatch.build(
                make_batch([torch.tensor([5])]), 0, device="cpu", layout="packed", round_trip=TRIP
            )
        ],
        "megatron",
    )


def test_routes_must_be_integers():
    with pytest.raises(BatchError, match="field 'routed_experts' must have an integer dtype"):
        make_batch([torch.tensor([5, 6])], **{ROUTED_EXPERTS: [torch.zeros(2, 2, 1)]})

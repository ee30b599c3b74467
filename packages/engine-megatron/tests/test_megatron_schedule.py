"""What the last pipeline stage hands the other stages: host numbers, never device tensors.

``broadcast_object`` pickles a CUDA tensor with its device, so the other stages unpickled the losses onto the
last stage's GPU. CPU tensors pickle the same way, so the payload is checked for plain numbers here (a JSON
round trip fails on any tensor); the 2-rank pipeline layouts in ``test_megatron_parallel`` check the values.
"""

from __future__ import annotations

import json

import pytest
import torch
from drivetrain_engine_core.backend import MicroBatchResult

pytestmark = pytest.mark.slow  # imports megatron-core


def _pipeline_of_two(monkeypatch, *, last_stage: bool, payload: list) -> None:
    from drivetrain_engine_megatron import schedule

    monkeypatch.setattr(schedule.mpu, "get_pipeline_model_parallel_world_size", lambda: 2)
    monkeypatch.setattr(schedule.mpu, "is_pipeline_last_stage", lambda ignore_virtual=False: last_stage)
    monkeypatch.setattr(schedule.mpu, "get_pipeline_model_parallel_last_rank", lambda: 1)
    monkeypatch.setattr(schedule.mpu, "get_pipeline_model_parallel_group", lambda: None)

    def broadcast_object(value, *, src, group):
        if last_stage:
            payload.append(value)
            return value
        return payload[-1]

    monkeypatch.setattr(schedule.distributed, "broadcast_object", broadcast_object)


def test_last_stage_shares_floats_and_other_stages_read_them(monkeypatch):
    from drivetrain_engine_megatron.schedule import _share_from_last_stage

    payload: list = []
    results = [
        MicroBatchResult(outputs=None, loss=torch.tensor(0.25), metrics={"kl": torch.tensor(2.0), "n": 3.0}),
        MicroBatchResult(outputs=None, loss=None, metrics={}),
    ]
    _pipeline_of_two(monkeypatch, last_stage=True, payload=payload)
    assert _share_from_last_stage(results, 2) is results
    assert json.loads(json.dumps(payload)) == [[[0.25, {"kl": 2.0, "n": 3.0}], [None, {}]]]

    _pipeline_of_two(monkeypatch, last_stage=False, payload=payload)
    shared = _share_from_last_stage([], 2)
    assert [(r.loss, r.metrics) for r in shared] == [(torch.tensor(0.25), {"kl": 2.0, "n": 3.0}), (None, {})]

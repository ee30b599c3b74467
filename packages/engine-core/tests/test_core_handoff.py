"""The weight hand-off protocol: bounded buckets, exact bytes, dtype casts, versions, and the receiver's checks."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from drivetrain_engine_core._handoff import BucketReceiver, bucket_tensors
from drivetrain_engine_core._handoff.bucket import ALIGNMENT
from drivetrain_engine_core.backend import EngineStateError, ModelConfig
from drivetrain_engine_core.rollout import HandoffError, WeightBucket
from drivetrain_engine_core.testing.tiny_engine import TinyEngineConfig, TinyTorchEngine

MIXED = {
    "a.weight": torch.randn(5, 3),
    "b.weight": torch.randn(7).to(torch.bfloat16),
    "c.index": torch.arange(6, dtype=torch.int64).reshape(2, 3),
    "d.flag": torch.tensor([True, False, True]),
    "e.scalar": torch.tensor(2.5),
    "f.strided": torch.randn(4, 6).t(),
    "g.big": torch.randn(40),
}


def received(buckets) -> dict[str, torch.Tensor]:
    """What a receiver sees: a copy of every tensor of every bucket."""
    return {name: tensor.clone() for bucket in buckets for name, tensor in bucket.tensors()}


def test_buckets_hold_the_exact_bytes_in_order_within_the_bound():
    buckets = list(bucket_tensors(iter(MIXED.items()), version=3, bucket_bytes=64))
    state = received(buckets)
    assert list(state) == list(MIXED)
    for name, tensor in MIXED.items():
        assert state[name].dtype == tensor.dtype and torch.equal(state[name], tensor), name
    assert [b.index for b in buckets] == list(range(len(buckets)))
    assert [b.last for b in buckets] == [False] * (len(buckets) - 1) + [True]
    assert {b.version for b in buckets} == {3} and {b.lora for b in buckets} == {"merged"}
    for bucket in buckets:
        if len(bucket.specs) > 1:
            assert bucket.nbytes <= 64, bucket.names
        assert all(spec.offset % ALIGNMENT == 0 for spec in bucket.specs)
    # g.big (160 bytes) is larger than the bound: a bucket of its own, holding only it.
    big = [b for b in buckets if "g.big" in b.names]
    assert big[0].names == ("g.big",) and big[0].nbytes == 160


def test_dtype_casts_floats_only_and_empty_streams_end_with_one_last_bucket():
    state = received(bucket_tensors(iter(MIXED.items()), version=0, dtype=torch.bfloat16))
    assert state["a.weight"].dtype == torch.bfloat16
    assert torch.equal(state["a.weight"], MIXED["a.weight"].to(torch.bfloat16))
    assert state["c.index"].dtype == torch.int64 and state["d.flag"].dtype == torch.bool
    (empty,) = bucket_tensors(iter(()), version=1)
    assert empty.last and empty.index == 0 and empty.specs == () and empty.nbytes == 0
    with pytest.raises(ValueError, match="bucket_bytes must be > 0"):
        next(bucket_tensors(iter(()), version=1, bucket_bytes=0))


def test_the_stream_holds_at_most_one_bucket_and_the_tensor_just_gathered():
    """A producer that gathers a fresh tensor per request sees every earlier one released by then."""
    alive: list[weakref.ref] = []
    held_at_request: list[int] = []

    def gathering_producer():
        for index in range(12):
            gc.collect()
            held_at_request.append(sum(ref() is not None for ref in alive))
            tensor = torch.full((8,), float(index))  # 32 bytes: "all-gathered" now
            alive.append(weakref.ref(tensor))
            yield f"t{index}", tensor
            del tensor

    live_buckets = []
    for bucket in bucket_tensors(gathering_producer(), version=0, bucket_bytes=100):
        assert bucket.nbytes <= 100
        live_buckets.append(weakref.ref(bucket.buffer))
        del bucket
        gc.collect()
        assert sum(ref() is not None for ref in live_buckets) <= 1
    assert held_at_request == [0] * 12, held_at_request


def _bucket(version: int, index: int, last: bool) -> WeightBucket:
    return WeightBucket(
        version=version,
        index=index,
        last=last,
        lora="merged",
        specs=(),
        buffer=torch.empty(0, dtype=torch.uint8),
    )


def test_receiver_refuses_stale_reordered_and_interleaved_streams():
    receiver = BucketReceiver()
    assert receiver.version is None
    receiver.accept(_bucket(1, 0, False))
    assert receiver.receiving and receiver.version is None  # partial: nothing complete to serve yet
    with pytest.raises(HandoffError, match="version 2 arrived while version 1 was still streaming"):
        receiver.accept(_bucket(2, 0, False))
    with pytest.raises(HandoffError, match="bucket 2 of version 1 arrived, but bucket 1 was expected"):
        receiver.accept(_bucket(1, 2, True))
    receiver.accept(_bucket(1, 1, True))
    assert receiver.version is None and not receiver.receiving  # ended, not yet applied
    with pytest.raises(HandoffError, match="arrived after the last bucket of version 1"):
        receiver.accept(_bucket(1, 2, False))
    assert receiver.commit() == 1 and receiver.version == 1
    with pytest.raises(HandoffError, match="stale weights: version 1 arrived after version 1"):
        receiver.accept(_bucket(1, 0, True))
    receiver.accept(_bucket(5, 0, False))
    with pytest.raises(HandoffError, match="ended before its last bucket"):
        receiver.commit()
    receiver.abort(applied=False)
    with pytest.raises(HandoffError, match="received no bucket"):
        receiver.commit()
    receiver.accept(_bucket(6, 0, True))
    assert receiver.commit() == 6


def test_a_stream_that_failed_at_its_last_bucket_leaves_the_previous_version_served():
    """The version was recorded when the last bucket arrived, before it was applied: a failure applying it left
    the failed version reported as served, and sending that version again was refused as stale."""
    receiver = BucketReceiver()
    receiver.accept(_bucket(1, 0, True))
    receiver.commit()
    receiver.accept(_bucket(2, 0, True))
    receiver.abort(applied=True)  # applying the bucket failed
    assert receiver.version == 1
    receiver.accept(_bucket(2, 0, True))
    assert receiver.commit() == 2


def test_engine_weight_buckets_equal_export_weights():
    engine = TinyTorchEngine(
        model_config=ModelConfig(path="unused"), engine_config=TinyEngineConfig(vocab_size=32, hidden_size=8)
    )
    engine.initialize()
    exported = dict(engine.export_weights())
    state = received(engine.weight_buckets(version=7, bucket_bytes=256))
    assert list(state) == list(exported)
    assert all(torch.equal(state[name], tensor) for name, tensor in exported.items())
    with pytest.raises(EngineStateError, match=r"needs LoRA adapters.*lora='merged'"):
        next(engine.weight_buckets(version=7, lora="adapter"))
    with pytest.raises(ValueError, match="choose one of"):
        next(engine.weight_buckets(version=7, lora="base"))  # type: ignore[arg-type]

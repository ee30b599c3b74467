"""Verified weight streams: per-tensor digests, delta streams against the sender's memory, the receiver's base
check, read-back verification and the adapter binding check.

Digests are checked against xxHash called directly on the tensors' bytes; a delta stream applied to the base
state is checked against a full stream of the same version, bit for bit.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import xxhash
from drivetrain_engine_core._handoff import BucketReceiver, SentVersions, bucket_tensors, verify_served
from drivetrain_engine_core.backend import ConfigError, ModelConfig
from drivetrain_engine_core.rollout import (
    DeltaBaseError,
    HandoffError,
    VerifyConfig,
    check_adapter_binding,
    check_arrived,
)
from drivetrain_engine_core.testing.tiny_engine import TinyEngineConfig, TinyTorchEngine

BOUND = 64


def weights(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "a.weight": torch.randn(5, 3, generator=generator),
        "b.weight": torch.randn(7, generator=generator).to(torch.bfloat16),
        "c.index": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "f.strided": torch.randn(4, 6, generator=generator).t(),
        "g.big": torch.randn(40, generator=generator),
    }


def raw_digest(tensor: torch.Tensor) -> str:
    """XXH3-128 of the tensor's row-major bytes, through integer views numpy can hold."""
    flat = tensor.contiguous().reshape(-1)
    if flat.dtype == torch.bfloat16:
        flat = flat.view(torch.int16)
    return xxhash.xxh3_128_hexdigest(flat.numpy().tobytes())


def apply(state: dict[str, torch.Tensor], buckets) -> dict[str, torch.Tensor]:
    """A receiver: the base ``state`` updated with every tensor the stream sent."""
    state = dict(state)
    for bucket in buckets:
        state.update((name, tensor.clone()) for name, tensor in bucket.tensors())
    return state


def test_every_tensor_carries_the_digest_of_the_bytes_sent_in_the_stream_dtype():
    tensors = weights()
    for dtype in (None, torch.bfloat16):
        buckets = list(bucket_tensors(iter(tensors.items()), version=1, bucket_bytes=BOUND, dtype=dtype))
        sent = {spec.name: spec.digest for bucket in buckets for spec in bucket.specs}
        for name, tensor in tensors.items():
            cast = tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor
            assert sent[name] == raw_digest(cast), (name, dtype)


def test_a_delta_stream_sends_what_changed_and_applied_to_its_base_equals_the_full_stream():
    sender, first = SentVersions(), weights()
    base_state = apply(
        {}, sender.stream(iter(first.items()), version=1, base_version=None, dtype=None, lora="merged")
    )
    second = {**first, "a.weight": first["a.weight"] + 1, "g.big": first["g.big"] * 2}
    delta = list(
        sender.stream(
            iter(second.items()), version=2, base_version=1, dtype=None, lora="merged", bucket_bytes=BOUND
        )
    )
    full = apply({}, bucket_tensors(iter(second.items()), version=2))
    assert {b.base_version for b in delta} == {1} and delta[-1].last
    assert sorted(name for b in delta for name in b.names) == ["a.weight", "g.big"]
    assert sorted(held.name for b in delta for held in b.unchanged) == ["b.weight", "c.index", "f.strided"]
    applied = apply(base_state, delta)
    assert list(applied) == list(full) or sorted(applied) == sorted(full)
    assert all(torch.equal(applied[name], tensor) for name, tensor in full.items())
    # A delta on the delta: version 2 is remembered as a whole (sent and unchanged tensors alike).
    third = dict(second, **{"b.weight": second["b.weight"] + 1})
    again = list(sender.stream(iter(third.items()), version=3, base_version=2, dtype=None, lora="merged"))
    assert [name for b in again for name in b.names] == ["b.weight"]


def test_a_base_the_sender_does_not_hold_in_that_stream_kind_gives_a_full_stream():
    sender, tensors = SentVersions(), weights()
    list(sender.stream(iter(tensors.items()), version=1, base_version=None, dtype=None, lora="merged"))
    for dtype, base_version in ((torch.bfloat16, 1), (None, 7)):
        buckets = list(
            sender.stream(
                iter(tensors.items()), version=2, base_version=base_version, dtype=dtype, lora="merged"
            )
        )
        assert {b.base_version for b in buckets} == {None}
        assert sorted(name for b in buckets for name in b.names) == sorted(tensors)


def test_in_a_bfloat16_stream_an_update_below_its_precision_is_no_change():
    """Changed bytes are judged in the stream dtype: an fp32 update too small to move a bf16 value sends nothing,
    where the fp32 stream of the same update sends the tensor."""
    tensors = {"w": torch.ones(8)}
    updated = {"w": torch.ones(8) + 1e-4}
    for dtype, expected in ((torch.bfloat16, []), (None, ["w"])):
        sender = SentVersions()
        list(sender.stream(iter(tensors.items()), version=1, base_version=None, dtype=dtype, lora="merged"))
        delta = sender.stream(iter(updated.items()), version=2, base_version=1, dtype=dtype, lora="merged")
        assert [name for b in delta for name in b.names] == expected, dtype


def _stream(version: int, base_version: int | None = None):
    """One bucket of a one-tensor stream, full or as a delta on ``base_version``."""
    sender = SentVersions()
    if base_version is not None:
        list(
            sender.stream(
                iter({"w": torch.ones(2)}.items()),
                version=base_version,
                base_version=None,
                dtype=None,
                lora="merged",
            )
        )
    (bucket,) = sender.stream(
        iter({"w": torch.ones(2)}.items()),
        version=version,
        base_version=base_version,
        dtype=None,
        lora="merged",
    )
    return bucket


def test_the_receiver_applies_a_delta_only_on_the_intact_version_it_serves():
    receiver = BucketReceiver()
    with pytest.raises(
        DeltaBaseError, match=r"delta on version 1, but this receiver serves version None.*in full"
    ):
        receiver.accept(_stream(2, base_version=1))
    receiver.abort(applied=False)
    receiver.accept(_stream(1))
    receiver.commit()
    receiver.accept(_stream(2, base_version=1))
    assert receiver.delta and [held.name for held in receiver.manifest] == ["w"]
    assert receiver.tensor_bytes_sent == 0 and receiver.commit() == 2
    receiver.accept(_stream(3))
    receiver.abort(applied=True)  # version 3 failed halfway: the served weights are neither 2 nor 3
    with pytest.raises(DeltaBaseError, match="holds partial weights"):
        receiver.accept(_stream(3, base_version=2))
    receiver.abort(applied=False)
    receiver.accept(_stream(3))
    receiver.commit()
    assert receiver.intact and receiver.version == 3


def test_every_tensor_is_checked_on_arrival_in_its_own_bytes():
    """Each tensor's slice of the buffer is hashed where it lies (bf16, int64, a strided source): an intact bucket
    passes, one byte flipped in any tensor is named with its bucket and version."""
    for dtype in (None, torch.bfloat16):
        buckets = list(bucket_tensors(iter(weights().items()), version=5, bucket_bytes=BOUND, dtype=dtype))
        for bucket in buckets:
            check_arrived(bucket)
            for spec in bucket.specs:
                buffer = bucket.buffer.clone()
                buffer[spec.offset + spec.nbytes - 1] ^= 0x01
                with pytest.raises(
                    HandoffError,
                    match=rf"bucket {bucket.index} of version 5: {spec.name} arrived with other bytes",
                ):
                    check_arrived(dataclasses.replace(bucket, buffer=buffer))


def test_verification_names_the_tensor_version_and_rank_of_a_mismatch():
    tensors = weights()
    manifest = [
        held
        for b in bucket_tensors(iter(tensors.items()), version=4, dtype=torch.bfloat16)
        for held in b.digests
    ]
    served = {
        name: t.to(torch.bfloat16).float() if t.is_floating_point() else t for name, t in tensors.items()
    }
    verify_served(manifest, served.get, version=4, rank=0)  # fp32 holding the bf16 values: the same bytes
    corrupt = dict(served, **{"g.big": served["g.big"].clone().index_fill_(0, torch.tensor([3]), 0.5)})
    with pytest.raises(HandoffError, match=r"version 4 on rank 1: g.big is served with other bytes"):
        verify_served(manifest, corrupt.get, version=4, rank=1)
    missing = {name: t for name, t in served.items() if name != "a.weight"}
    missing["c.index"] = missing["c.index"].reshape(3, 2)
    with pytest.raises(HandoffError, match=r"a.weight is not served \(and 1 more tensors\)"):
        verify_served(manifest, missing.get, version=4, rank=0)


def test_verify_config_schedules_the_first_and_every_nth_version():
    assert [VerifyConfig(every_n=3).due(n) for n in range(7)] == [
        True,
        False,
        False,
        True,
        False,
        False,
        True,
    ]
    assert all(VerifyConfig(mode="every").due(n) for n in range(3))
    assert not any(VerifyConfig(mode="never").due(n) for n in range(3))
    with pytest.raises(ConfigError, match="every_n must be >= 1"):
        VerifyConfig(every_n=0)
    with pytest.raises(ConfigError, match=r"'sometimes' is not one of"):
        VerifyConfig(mode="sometimes")  # type: ignore[arg-type]


def test_an_adapter_that_binds_no_module_or_misses_a_target_is_refused():
    modules = ["model", "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj", "lm_head"]
    config = {"target_modules": ["q_proj", "v_proj"]}
    check_adapter_binding(config, modules, modules[1:3])
    with pytest.raises(HandoffError, match="bound zero modules"):
        check_adapter_binding(config, modules, [])
    with pytest.raises(HandoffError, match=r"left 1 modules .*v_proj'\]"):
        check_adapter_binding(config, modules, modules[1:2])
    with pytest.raises(HandoffError, match="left 1 modules"):
        check_adapter_binding({"target_modules": r".*\.(q|v)_proj"}, modules, modules[1:2])


def test_engine_weight_buckets_pass_the_base_version_through():
    engine = TinyTorchEngine(
        model_config=ModelConfig(path="unused"), engine_config=TinyEngineConfig(vocab_size=32, hidden_size=8)
    )
    engine.initialize()
    first = apply({}, engine.weight_buckets(version=1))
    name, tensor = next(iter(engine.model.state_dict().items()))
    with torch.no_grad():
        tensor.add_(1.0)  # an update of one tensor
    delta = list(engine.weight_buckets(version=2, base_version=1))
    assert [n for b in delta for n in b.names] == [name] and delta[0].base_version == 1
    full = apply({}, engine.weight_buckets(version=3))
    assert all(torch.equal(apply(first, delta)[n], t) for n, t in full.items())

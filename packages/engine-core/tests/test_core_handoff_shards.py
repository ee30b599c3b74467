"""Delta streams decided from local shards (``handoff.local_shards``), on one process: a group is gathered only
when its local shards changed since the base version, and the stream equals the one decided on gathered tensors."""

from __future__ import annotations

import torch
from drivetrain_engine_core._handoff import ExportBytes, SentShards, digest_of
from drivetrain_engine_core.backend import ShardedWeight


class Model:
    """Three weights held as two halves each (a rank's shard and the rest); gathers are counted by name."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.weights = {f"w{i}": torch.randn(2, 64, 16, generator=generator) for i in range(3)}
        self.gathered: list[str] = []

    def groups(self):
        for name, halves in self.weights.items():
            yield ShardedWeight(key=name, local=(halves[0],), gather=lambda name=name: self._gather(name))

    def _gather(self, name):
        self.gathered.append(name)
        yield f"model.{name}", self.weights[name].reshape(128, 16)

    def full(self):
        return {f"model.{name}": halves.reshape(128, 16) for name, halves in self.weights.items()}


def received(buckets):
    return {name: tensor.clone() for bucket in buckets for name, tensor in bucket.tensors()}


def test_only_groups_whose_local_shard_changed_are_gathered_and_the_delta_applies_to_the_full_state():
    model, sent = Model(), SentShards()
    options = {"dtype": None, "lora": "merged", "bucket_bytes": 8 << 10}
    version_0 = received(sent.stream(model.groups(), version=0, base_version=None, **options))
    assert model.gathered == ["w0", "w1", "w2"] and sent.last == ExportBytes(gathered=24576, sent=24576)
    model.weights["w1"][0, 3, 5] += 1.0  # this rank's shard of w1 changes
    model.gathered = []
    buckets = list(sent.stream(model.groups(), version=1, base_version=0, **options))
    assert model.gathered == ["w1"] and sent.last == ExportBytes(gathered=8192, sent=8192)
    assert [held.name for b in buckets for held in b.unchanged] == ["model.w0", "model.w2"]
    applied = {**version_0, **received(buckets)}
    assert all(torch.equal(applied[name], tensor) for name, tensor in model.full().items())
    # Listed unchanged with the digests of the bytes version 0 sent (what a receiver checks them against).
    unchanged = {held.name: held.digest for b in buckets for held in b.unchanged}
    assert unchanged == {name: digest_of(version_0[name]) for name in ("model.w0", "model.w2")}
    # A base no longer remembered: the stream goes in full, gathering everything.
    model.gathered = []
    list(sent.stream(model.groups(), version=2, base_version=7, **options))
    assert model.gathered == ["w0", "w1", "w2"] and sent.last.gathered == 24576

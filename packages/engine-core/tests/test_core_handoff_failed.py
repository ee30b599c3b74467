"""A stream that fails midway: a rollout that holds the stream aside until it is whole keeps serving the previous
version (and says so in the error); one that loads in place refuses to generate until a complete version."""

from __future__ import annotations

import pytest
import torch
from drivetrain_engine_core._handoff import SentVersions
from drivetrain_engine_core.backend import EngineStateError
from drivetrain_engine_core.rollout import HandoffError, Rollout, SamplingConfig

NAMES = [f"layer.{i}.weight" for i in range(6)]
GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=1)


def state(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(64, 32, generator=generator) for name in NAMES}


class HeldAside(Rollout):
    """Serves a dict of tensors: held aside until the last bucket (``in_place=False``), or written as they arrive;
    ``generate`` answers one log-prob per prompt: the sum of every served tensor (what the test compares)."""

    def __init__(self, *, in_place: bool) -> None:
        super().__init__(model_path="unused")
        self.in_place, self.served, self.incoming = in_place, state(0), {}

    def _load_bucket(self, bucket):
        target = self.served if self.in_place else self.incoming
        target.update((name, tensor.clone()) for name, tensor in bucket.tensors())

    def _finish_update(self):
        self.served.update(self.incoming)

    def _abort_update(self):
        self.incoming = {}

    def _serves_previous_version(self):
        return not self.in_place

    def _served_tensor(self, name):
        return self.served.get(name)

    def _generate(self, prompts, sampling):
        total = torch.stack([tensor.sum() for tensor in self.served.values()]).sum()
        return [torch.tensor([0])] * len(prompts), [total.reshape(1)] * len(prompts)

    def _sleep(self): ...
    def _wake(self): ...


def send(sender, weights, version, base_version=None):
    """``weights`` streamed as version ``version`` in 16 KiB buckets (two of the tensors each)."""
    items = iter(weights.items())
    return list(
        sender.stream(
            items,
            version=version,
            base_version=base_version,
            dtype=None,
            lora="merged",
            bucket_bytes=16 << 10,
        )
    )


def cut_after(buckets, count):
    """The stream as a sender whose connection drops after ``count`` buckets."""
    yield from buckets[:count]
    raise ConnectionError("the trainer's connection was cut")


def summed(weights) -> torch.Tensor:
    return torch.stack([tensor.sum() for tensor in weights.values()]).sum()


@pytest.mark.parametrize("failure", ["connection cut", "corrupted bucket"])
def test_a_rollout_holding_the_stream_aside_keeps_serving_the_previous_version(failure):
    sender, rollout = SentVersions(), HeldAside(in_place=False)
    rollout.update_weights(send(sender, state(1), 1))
    buckets = send(sender, state(2), 2)
    assert len(buckets) == 3  # 6 tensors of 8 KiB, two a bucket
    if failure == "connection cut":
        stream, error = cut_after(buckets, 2), ConnectionError
    else:
        buckets[2].buffer[buckets[2].specs[0].offset] ^= 0x40
        stream, error = iter(buckets), HandoffError
    with pytest.raises(error) as failed:
        rollout.update_weights(stream)
    assert failed.value.__notes__ == [
        "The rollout still serves version 1 (none of the failed stream reached them), and generate() goes on "
        "with it."
    ]
    assert rollout.weights_version == 1 and rollout.delta_base == 1
    (log_prob,) = rollout.generate([[1]], GREEDY).log_probs
    assert torch.equal(log_prob, summed(state(1)).reshape(1))
    # A delta on version 1 builds on it: it sends only what changed and serves version 3 whole.
    third = {**state(1), NAMES[0]: state(3)[NAMES[0]]}
    delta = send(sender, third, 3, base_version=1)
    assert [b.names for b in delta] == [(NAMES[0],)]
    assert rollout.update_weights(delta) == 3
    assert torch.equal(rollout.generate([[1]], GREEDY).log_probs[0], summed(third).reshape(1))


def test_a_rollout_loading_in_place_refuses_to_generate_after_a_cut_stream():
    sender, rollout = SentVersions(), HeldAside(in_place=True)
    rollout.update_weights(send(sender, state(1), 1))
    buckets = send(sender, state(2), 2)
    with pytest.raises(ConnectionError) as failed:
        rollout.update_weights(cut_after(buckets, 2))
    assert "refuses to generate until a complete version arrives" in failed.value.__notes__[0]
    assert rollout.weights_version == 1 and rollout.delta_base is None
    with pytest.raises(EngineStateError, match="failed midway"):
        rollout.generate([[1]], GREEDY)

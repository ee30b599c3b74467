"""``RolloutConformanceTests``: the test class every rollout subclasses to prove it keeps the Rollout contract.

Like :mod:`.conformance` for engines: a rollout's test file holds a short subclass naming it, and inherits
every check below. The weights come from core's own stream (``SentVersions``, what ``Engine.weight_buckets``
runs) over tiny-model versions made by :mod:`.policies`; the reference is the plain Hugging Face model with
the same weights, never the rollout itself.

Example::

    from drivetrain_engine_core.testing.rollout_conformance import RolloutConformanceTests

    class TestMyRolloutConformance(RolloutConformanceTests):
        rollout_name = "mine"        # built through the plugin registry with create_rollout
        supports_adapters = False    # skip what the rollout does not offer
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from drivetrain_engine_core._errors import EngineStateError
from drivetrain_engine_core._handoff import (
    DeltaBaseError,
    HandoffError,
    SentVersions,
    VerifyConfig,
    WeightBucket,
)
from drivetrain_engine_core._rollout import (
    FAILED_KEEPS,
    FAILED_REFUSES,
    Rollout,
    SamplingConfig,
    create_rollout,
)
from drivetrain_engine_core.testing.kit import KitBase
from drivetrain_engine_core.testing.policies import (
    State,
    actor_log_probs,
    base_state,
    folded,
    lora_adapters,
    moved,
    save_policy,
    stream,
)

PROMPTS = ([1, 5, 6, 7], [1, 9], [1, 12, 13])
SAMPLED = SamplingConfig(n=2, temperature=0.7, max_new_tokens=5, seed=3)
GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=5)
EVERY = VerifyConfig(mode="every")
LONG_PROMPT = [1, *(3 + (7 * i) % 100 for i in range(299))]
"""300 tokens: more than two of vLLM's 128-token KV blocks on CPUs (18 of its 16-token ones on GPUs), so a
prefix cache keeps most of it across requests."""
CHANGED_AT_2 = ("model.layers.0.self_attn.q_proj.weight", "model.norm.weight")
"""What version 2 changes of version 1: a delta stream sends these two tensors only."""


class RolloutConformanceTests(KitBase):
    """Checks every rollout must pass; subclass it in a ``Test*`` class of the rollout's test suite."""

    rollout_name: ClassVar[str] = ""
    """Registered rollout name used by the default :meth:`rollout_factory`."""
    log_prob_atol: ClassVar[float] = 1e-5
    """Largest gap between the rollout's sampled log-probs and the plain model's (fp32)."""
    log_prob_error_factor: ClassVar[float] = 4.0
    """The agreement bound: a rollout's sampled-token log-probs are at most this many times as far from a float64
    forward of the same weights as the plain float32 forward is, token set by token set (measured on the kit's
    models, short and 300-token prompts: 1.0 for ``hf``, up to 1.6 for ``vllm``)."""
    supports_adapters: ClassVar[bool] = True
    """Whether the rollout takes ``lora="adapter"`` streams."""
    keeps_adapter_version_after_failure: ClassVar[bool] = False
    """Whether an adapter stream that fails midway leaves the previous version serving (the rollout holds it
    aside until whole: :meth:`Rollout._serves_previous_version`), rather than refusing to generate."""

    # ------------------------------------------------------------------ hooks for subclasses
    def rollout_factory(self, model_dir: Path, *, verify: VerifyConfig) -> Rollout:
        """Build the rollout under test over ``model_dir`` with the given verification schedule."""
        if not self.rollout_name:
            raise NotImplementedError(
                f"{type(self).__name__}: set `rollout_name = ...` or override rollout_factory()."
            )
        return create_rollout(self.rollout_name, model_path=str(model_dir), device=self.device, verify=verify)

    # ------------------------------------------------------------------ fixtures
    @pytest.fixture(scope="class")
    @classmethod
    def versions(cls, model_dir: Path) -> dict[int, State]:
        """Version 1 moves every weight; version 2 moves :data:`CHANGED_AT_2` of version 1 only."""
        first = moved(base_state(model_dir), seed=1)
        return {1: first, 2: moved(first, seed=2, names=CHANGED_AT_2)}

    # ------------------------------------------------------------------ helpers
    def make(self, model_dir: Path, verify: VerifyConfig = EVERY) -> Rollout:
        return self.rollout_factory(model_dir, verify=verify)

    def stream(self, sender: SentVersions, state: State, version: int, **options: Any) -> list[WeightBucket]:
        """:func:`.policies.stream` from an engine on the rollout's device."""
        return stream(sender, state, version, device=self.device, **options)

    @staticmethod
    def same_outputs(first: Rollout, second: Rollout) -> bool:
        """Whether both rollouts sample and decode the same tokens with the same log-probs, bit for bit."""
        for sampling in (SAMPLED, GREEDY):
            a, b = first.generate(list(PROMPTS), sampling), second.generate(list(PROMPTS), sampling)
            pairs = zip(a.responses + a.log_probs, b.responses + b.log_probs, strict=True)
            if not all(torch.equal(x.cpu(), y.cpu()) for x, y in pairs):
                return False
        return True

    @staticmethod
    def outputs(rollout: Rollout) -> list[torch.Tensor]:
        """What ``rollout`` samples and decodes for the kit's prompts: tokens and log-probs."""
        made = [rollout.generate(list(PROMPTS), sampling) for sampling in (SAMPLED, GREEDY)]
        return [tensor.cpu() for output in made for tensor in output.responses + output.log_probs]

    def assert_failure_left(self, rollout: Rollout, error: BaseException, before: list[torch.Tensor]) -> None:
        """After a failed update: per :attr:`keeps_adapter_version_after_failure`, the error's note says the
        previous version serves on and the rollout samples as it did ``before``, bit for bit, or it says
        generation is refused until a complete version arrives, and it is."""
        (note,) = error.__notes__
        if self.keeps_adapter_version_after_failure:
            assert note.startswith(FAILED_KEEPS), note
            assert all(torch.equal(a, b) for a, b in zip(self.outputs(rollout), before, strict=True))
        else:
            assert note == FAILED_REFUSES, note
            with pytest.raises(EngineStateError, match="partial or wrong"):
                rollout.generate(list(PROMPTS), GREEDY)

    def assert_log_probs_match(self, rollout: Rollout, policy_dir: Path) -> None:
        output = rollout.generate(list(PROMPTS), SAMPLED)
        expected = actor_log_probs(policy_dir, PROMPTS, output, SAMPLED.temperature)
        for rolled, actor in zip(output.log_probs, expected, strict=True):
            torch.testing.assert_close(rolled.cpu(), actor, atol=self.log_prob_atol, rtol=0)

    # ------------------------------------------------------------------ sampling
    def test_equal_prompts_in_one_call_are_sampled_independently_and_the_call_repeats(
        self, model_dir: Path
    ) -> None:
        """A group's multi-turn episodes start from equal prompts with ``n=1`` each, and data sets repeat prompts:
        each is its own draw (a rollout that seeds every request alike samples them all alike: a group without
        variance), and the same call with the same seed repeats."""
        rollout = self.make(model_dir)
        sampling = SamplingConfig(n=1, temperature=1.0, max_new_tokens=12, seed=3)
        first = [r.tolist() for r in rollout.generate([PROMPTS[0]] * 4, sampling).responses]
        again = [r.tolist() for r in rollout.generate([PROMPTS[0]] * 4, sampling).responses]
        assert len({tuple(r) for r in first}) == 4, f"four equal prompts sampled {first}"
        assert again == first

    # ------------------------------------------------------------------ versions and refusals
    def test_versions_are_recorded_only_for_complete_newer_streams(self, model_dir: Path, versions) -> None:
        rollout, sender = self.make(model_dir), SentVersions()
        assert (rollout.weights_version, rollout.delta_base) == (None, None)
        assert rollout.update_weights(self.stream(sender, versions[1], 1)) == 1
        assert rollout.generate(list(PROMPTS), GREEDY).version == 1 and rollout.delta_base == 1
        with pytest.raises(HandoffError, match="stale weights: version 1 arrived after version 1"):
            rollout.update_weights(self.stream(sender, versions[2], 1))
        # Refused at its first bucket, the stale stream applied nothing: version 1 is still served.
        assert rollout.weights_version == 1 and rollout.generate(list(PROMPTS), GREEDY).version == 1

    def test_reordered_and_partial_streams_are_refused(self, model_dir: Path, versions) -> None:
        rollout, sender = self.make(model_dir), SentVersions()
        buckets = self.stream(sender, versions[1], 1)
        assert len(buckets) > 2, "the kit's streams must span several buckets"
        for broken, error in (
            (
                [buckets[0], buckets[2], buckets[1], *buckets[3:]],
                "bucket 2 of version 1 arrived, but bucket 1",
            ),
            (buckets[:-1], "ended before its last bucket"),
        ):
            with pytest.raises(HandoffError, match=error):
                rollout.update_weights(broken)
            with pytest.raises(EngineStateError, match="partial or wrong"):
                rollout.generate(list(PROMPTS), GREEDY)
            assert rollout.weights_version is None and rollout.delta_base is None
        assert rollout.update_weights(buckets) == 1 and rollout.generate(list(PROMPTS), GREEDY).version == 1

    # ------------------------------------------------------------------ full and delta streams
    def test_a_full_stream_samples_with_the_actors_log_probs(
        self, model_dir: Path, versions, tmp_path
    ) -> None:
        rollout, buckets = self.make(model_dir), self.stream(SentVersions(), versions[1], 1)
        rollout.update_weights(buckets)
        self.assert_log_probs_match(rollout, save_policy(model_dir, versions[1], tmp_path / "v1"))
        sync = rollout.last_sync
        assert sync is not None and (sync.version, sync.delta, sync.verified) == (1, False, True)
        assert sync.bytes_sent == sum(b.nbytes for b in buckets) and sync.fraction_changed == 1.0

    def test_a_bfloat16_stream_is_served_and_verified_in_its_dtype(self, model_dir: Path, versions) -> None:
        """A served model in another dtype than the stream's passes verification when casting what it serves back
        to the stream dtype gives the bytes sent."""
        rollout = self.make(model_dir)
        rollout.update_weights(self.stream(SentVersions(), versions[1], 1, dtype=torch.bfloat16))
        assert rollout.last_sync is not None and rollout.last_sync.verified

    def test_a_delta_stream_serves_what_the_full_stream_serves(self, model_dir: Path, versions) -> None:
        sender, by_delta, by_full = SentVersions(), self.make(model_dir), self.make(model_dir)
        by_delta.update_weights(self.stream(sender, versions[1], 1))
        delta = self.stream(sender, versions[2], 2, base_version=1)
        assert sorted(name for b in delta for name in b.names) == sorted(CHANGED_AT_2)
        assert by_delta.update_weights(delta) == 2  # verified: every served tensor has version 2's digest
        by_full.update_weights(self.stream(SentVersions(), versions[2], 2))
        assert self.same_outputs(by_delta, by_full)
        sync, nbytes = by_delta.last_sync, {n: t.numel() * t.element_size() for n, t in versions[2].items()}
        assert sync is not None and sync.delta and sync.verified
        assert sync.fraction_changed == pytest.approx(
            sum(nbytes[n] for n in CHANGED_AT_2) / sum(nbytes.values())
        )

    def test_a_delta_on_another_base_is_refused_before_anything_is_applied(
        self, model_dir: Path, versions
    ) -> None:
        sender, rollout = SentVersions(), self.make(model_dir)
        rollout.update_weights(self.stream(sender, versions[1], 1))
        self.stream(sender, versions[2], 2)  # sent elsewhere: this rollout never received version 2
        with pytest.raises(DeltaBaseError, match="delta on version 2, but this receiver serves version 1"):
            rollout.update_weights(self.stream(sender, versions[1], 3, base_version=2))
        assert rollout.generate(list(PROMPTS), GREEDY).version == 1 and rollout.delta_base == 1
        with pytest.raises(HandoffError, match="ended before its last bucket"):
            rollout.update_weights(self.stream(sender, versions[2], 4)[:-1])
        assert rollout.delta_base is None  # partial weights are no base
        with pytest.raises(DeltaBaseError, match="holds partial weights"):
            rollout.update_weights(self.stream(sender, versions[2], 4, base_version=1))
        assert rollout.update_weights(self.stream(sender, versions[2], 4)) == 4 and rollout.delta_base == 4

    def test_sampled_log_probs_are_as_exact_as_the_fp32_forward(
        self, model_dir: Path, versions, tmp_path: Path
    ) -> None:
        """The agreement bound, stated against float64 rather than as a fixed tolerance: a float32 forward's own
        round-off grows with the logits and the sequence, so no fixed number holds for every model."""
        rollout = self.make(model_dir)
        rollout.update_weights(self.stream(SentVersions(), versions[1], 1))
        policy_dir = save_policy(model_dir, versions[1], tmp_path / "v1")
        for prompts in (PROMPTS, [LONG_PROMPT]):
            output = rollout.generate(list(prompts), SAMPLED)
            exact, fp32 = (
                torch.cat(actor_log_probs(policy_dir, prompts, output, SAMPLED.temperature, dtype=dtype))
                for dtype in (torch.float64, torch.float32)
            )
            rolled = torch.cat([log_probs.cpu() for log_probs in output.log_probs]).double()
            fp32_error, rollout_error = (fp32 - exact).abs().max().item(), (rolled - exact).abs().max().item()
            # NOTE: never below one float32 step of the largest log-prob, which a float32 output cannot beat.
            fp32_error = max(fp32_error, torch.finfo(torch.float32).eps * exact.abs().max().item())
            assert rollout_error <= self.log_prob_error_factor * fp32_error, (
                f"{len(prompts[0])}-token prompt: the rollout's log-probs are {rollout_error:.3g} from a float64 "
                f"forward, the plain float32 forward's {fp32_error:.3g} (bound: {self.log_prob_error_factor}x)"
            )

    # ------------------------------------------------------------------ caches
    def test_a_prompt_seen_before_a_hand_off_is_sampled_with_the_new_weights(
        self, model_dir: Path, versions, tmp_path: Path
    ) -> None:
        """Whatever a rollout keeps across requests (a prefix cache's KV, graphs that captured weights) is
        dropped when a new version is served: the same long prompt after the hand-off has its log-probs."""
        rollout = self.make(model_dir)
        rollout.generate([LONG_PROMPT], SAMPLED)  # under the checkpoint's weights, which every version moves
        rollout.update_weights(self.stream(SentVersions(), versions[1], 1))
        output = rollout.generate([LONG_PROMPT], SAMPLED)
        policy_dir = save_policy(model_dir, versions[1], tmp_path / "v1")
        expected = actor_log_probs(policy_dir, [LONG_PROMPT], output, SAMPLED.temperature)
        for rolled, actor in zip(output.log_probs, expected, strict=True):
            torch.testing.assert_close(rolled.cpu(), actor, atol=self.log_prob_atol, rtol=0)

    # ------------------------------------------------------------------ arrival and verification
    def test_verification_catches_a_tensor_corrupted_in_flight(self, model_dir: Path, versions) -> None:
        """Every tensor is checked against its digest on arrival, whatever the read-back schedule: a byte
        flipped in a version the schedule does not read back is refused before its bucket is applied."""
        # The default, periodic schedule reads version 1 back, not version 2.
        sender, rollout = SentVersions(), self.make(model_dir, VerifyConfig())
        rollout.update_weights(self.stream(sender, versions[1], 1))
        buckets = self.stream(sender, versions[2], 2)
        target = buckets[1].specs[0]
        with pytest.raises(
            HandoffError,
            match=f"bucket 1 of version 2: {target.name} arrived with other bytes than were sent",
        ):
            rollout.update_weights([buckets[0], _flip_a_byte(buckets[1], target.offset), *buckets[2:]])
        assert rollout.weights_version == 1
        with pytest.raises(EngineStateError, match="partial or wrong"):
            rollout.generate(list(PROMPTS), GREEDY)
        assert rollout.update_weights(buckets) == 2
        assert rollout.last_sync is not None and not rollout.last_sync.verified

    def test_verification_catches_a_tensor_served_with_other_bytes(self, model_dir: Path, versions) -> None:
        """A stream can arrive intact and still not be what is served: here a delta stream lists a tensor as
        unchanged with bytes the served one does not have; reading back what is served finds it."""
        sender, rollout = SentVersions(), self.make(model_dir)
        rollout.update_weights(self.stream(sender, versions[1], 1))
        delta = self.stream(sender, versions[2], 2, base_version=1)
        listing = next(i for i, bucket in enumerate(delta) if bucket.unchanged)
        target = delta[listing].unchanged[0]
        wrong = dataclasses.replace(target, digest=format(int(target.digest, 16) ^ 1, "032x"))
        delta[listing] = dataclasses.replace(delta[listing], unchanged=(wrong, *delta[listing].unchanged[1:]))
        with pytest.raises(
            HandoffError, match=f"version 2 on rank 0: {target.name} is served with other bytes"
        ):
            rollout.update_weights(delta)
        assert rollout.weights_version == 1
        with pytest.raises(EngineStateError, match="failed verification"):
            rollout.generate(list(PROMPTS), GREEDY)
        assert rollout.update_weights(self.stream(sender, versions[2], 3)) == 3
        assert rollout.generate(list(PROMPTS), GREEDY).version == 3

    def test_the_verification_schedule_is_kept(self, model_dir: Path, versions) -> None:
        sender, rollout = SentVersions(), self.make(model_dir, VerifyConfig(every_n=2))
        verified = []
        for version in (1, 2, 3):
            rollout.update_weights(self.stream(sender, versions[1 + version % 2], version))
            verified.append(rollout.last_sync.verified if rollout.last_sync else None)
        assert verified == [True, False, True]
        unchecked = self.make(model_dir, VerifyConfig(mode="never"))
        unchecked.update_weights(self.stream(SentVersions(), versions[1], 1))
        assert unchecked.last_sync is not None and not unchecked.last_sync.verified

    # ------------------------------------------------------------------ adapters
    def test_adapter_streams_serve_the_folded_weights(self, model_dir: Path, tmp_path: Path) -> None:
        if not self.supports_adapters:
            pytest.skip(f"{type(self).__name__} does not take adapter streams")
        base, sender = base_state(model_dir), SentVersions()
        first, rollout = lora_adapters(model_dir, seed=1), self.make(model_dir)
        rollout.update_weights(self.stream(sender, first, 1, lora="adapter"))
        self.assert_log_probs_match(rollout, save_policy(model_dir, folded(base, first), tmp_path / "v1"))
        # Version 2 retrains layer 0's adapters only: the delta sends those, and serves the full stream's bits.
        second = {**first, **lora_adapters(model_dir, seed=2, layers=[0])}
        delta = self.stream(sender, second, 2, base_version=1, lora="adapter")
        assert {name.split(".")[4] for b in delta for name in b.names} == {"0"}
        rollout.update_weights(delta)
        full = self.make(model_dir)
        full.update_weights(self.stream(SentVersions(), second, 2, lora="adapter"))
        assert self.same_outputs(rollout, full)
        self.check_a_corrupted_adapter_stream(rollout, sender, lora_adapters(model_dir, seed=3))

    def check_a_corrupted_adapter_stream(
        self, rollout: Rollout, sender: SentVersions, adapters: State
    ) -> None:
        """The last bucket of the next version arrives corrupted, after others were handed to the rollout: it
        serves the previous version on, as it sampled it, and a delta may build on it; or (loaded in place) it
        refuses to generate (:attr:`keeps_adapter_version_after_failure` says which)."""
        served, before = rollout.weights_version, self.outputs(rollout)
        assert served is not None
        buckets = self.stream(sender, adapters, served + 1, lora="adapter", bucket_bytes=1024)
        assert len(buckets) > 2, (
            "the adapters fit one bucket: nothing would be handed over before the failure"
        )
        target = buckets[-1].specs[0]
        with pytest.raises(HandoffError, match=f"{target.name} arrived with other bytes") as failed:
            rollout.update_weights([*buckets[:-1], _flip_a_byte(buckets[-1], target.offset)])
        assert rollout.weights_version == served
        self.assert_failure_left(rollout, failed.value, before)
        assert rollout.delta_base == (served if self.keeps_adapter_version_after_failure else None)

    def test_an_adapter_stream_that_binds_no_module_is_refused(self, model_dir: Path) -> None:
        if not self.supports_adapters:
            pytest.skip(f"{type(self).__name__} does not take adapter streams")
        rollout, adapters = self.make(model_dir), lora_adapters(model_dir, seed=1)
        before = self.outputs(rollout)
        with pytest.raises(HandoffError, match="bound zero modules"):
            rollout.update_weights(self.stream(SentVersions(), {}, 1, lora="adapter"))
        only_q = {name: tensor for name, tensor in adapters.items() if ".v_proj." not in name}
        with pytest.raises(
            HandoffError, match=r"left \d+ modules that target_modules=.* selects without an adapter"
        ) as refused:
            rollout.update_weights(self.stream(SentVersions(), only_q, 1, lora="adapter"))
        self.assert_failure_left(rollout, refused.value, before)


def _flip_a_byte(bucket: WeightBucket, offset: int) -> WeightBucket:
    """``bucket`` with one byte of its buffer changed after the sender hashed it: corruption in flight."""
    buffer = bucket.buffer.clone()
    buffer[offset] ^= 0x40
    return dataclasses.replace(bucket, buffer=buffer)

"""The ``Rollout`` contract: an inference engine that takes weights from training and samples responses.

Rollouts are plugins (``register_rollouts``), so an inference backend (vLLM, SGLang) is a separate install;
drivetrain-roles ships the Hugging Face ``generate`` one (``hf``). Public methods own the checks (template
method): a rollout serves only complete, newer weight versions (:class:`~.handoff.BucketReceiver`), applies a
delta stream only on the base it serves intact, checks every tensor against the stream's digest as it arrives
and what it serves when its :class:`~.handoff.VerifyConfig` says, drops what it caches across requests once a new
version's weights are in place, refuses to generate while asleep or while an update is partial or failed
verification, and answers with the version its weights come from.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from . import _distributed as distributed
from ._config import ConfigError
from ._errors import EngineStateError
from ._handoff import BucketReceiver, SyncMetrics, VerifyConfig, WeightBucket, check_arrived, verify_served
from ._rollout_options import RolloutOptions, build_rollout_options
from ._sampling import SamplingConfig


@dataclass(frozen=True)
class RolloutOutput:
    """Responses to ``P`` prompts, ``n`` each, prompt-major: response ``i`` answers prompt ``i // n``.

    Attributes:
        responses: token ids of each response (up to and including the end-of-sequence token, if sampled).
        log_probs: float32 log-probability of each response token under the served weights, at the sampling
            temperature (temperature 1 for greedy decoding), same lengths as ``responses``.
        version: the weight version that produced them (``None``: the weights loaded at construction).
        n: responses per prompt.
        routed_experts: with ``SamplingConfig.record_routed_experts``, each prompt+response's routed experts
            ``(prompt + response tokens, layers, top_k)`` (:mod:`.router_replay`: prompt tokens the prefill's
            routing, the last token ``NOT_RECORDED``); ``None`` otherwise.
    """

    responses: list[torch.Tensor]
    log_probs: list[torch.Tensor]
    version: int | None
    n: int
    routed_experts: list[torch.Tensor] | None = None


class RecordsRoutedExperts(ABC):
    """A rollout that records each token's routed experts (router replay); mixed into its :class:`Rollout`."""

    @abstractmethod
    def _take_routed_experts(self) -> list[torch.Tensor]:
        """The routes of the last ``_generate`` call (one per response, as :attr:`RolloutOutput.routed_experts`)."""


class Rollout(ABC):
    """A generation engine that receives weight buckets from a training engine.

    Every tensor is checked against the digest the sender took as its bucket arrives, before the bucket is
    applied, whatever ``verify`` says (:func:`~.handoff.check_arrived`: about 30 us per MiB on one CPU core, 0.06 s
    for a 0.5B-parameter fp32 model, plus one copy to host memory per bucket that arrives on an accelerator);
    ``verify`` schedules the costlier read-back of what is served.

    Args:
        model_path: the Hugging Face model directory whose architecture (and initial weights) it serves.
        device: where it runs (``cpu``, ``cuda``).
        verify: when to check the served weights against the stream's digests (default: the first version
            and every 10th).
    """

    name: ClassVar[str] = ""
    """The name the rollout registers under (``hf``)."""

    options_class: ClassVar[type[RolloutOptions]] = RolloutOptions
    """The rollout's own options (a job's ``rollout.options.*``): a plugin's :class:`RolloutOptions` subclass,
    which its constructor takes built and checked as ``options=``; the base (no options, and no ``options=``
    passed) for a rollout that declares none."""

    def __init__(self, *, model_path: str, device: str = "cpu", verify: VerifyConfig | None = None) -> None:
        self.model_path = model_path
        self.device = device
        self.verify = verify or VerifyConfig()
        self.last_sync: SyncMetrics | None = None
        """What the last completed ``update_weights`` cost (``None`` before one)."""
        self._receiver = BucketReceiver()
        self._asleep = False
        self._unusable: str | None = None  # why generate() is refused until a complete version arrives
        self._committed = 0
        self._verify_next = False

    @property
    def weights_version(self) -> int | None:
        """The version of the served weights (``None``: as loaded from ``model_path``)."""
        return self._receiver.version

    @property
    def delta_base(self) -> int | None:
        """The version a delta stream may build on (``weight_buckets(base_version=...)``): the served version
        while the served weights are exactly it; ``None`` (send in full) before any, or after a failed update."""
        return self._receiver.version if self._receiver.intact else None

    @property
    def asleep(self) -> bool:
        return self._asleep

    def update_weights(self, buckets: Iterable[WeightBucket]) -> int:
        """Load one complete hand-off (``engine.weight_buckets(...)``), bucket by bucket, then verify it if due.

        Returns:
            The new weight version (:attr:`last_sync` says what the update cost).

        Raises:
            HandoffError: a bucket is stale, reordered or from another stream, a tensor arrived with other bytes
                than were sent (that bucket is not applied), the stream ended before its last bucket, the
                weights do not fit the served model, or they failed verification; once anything of the stream
                reached the served weights, the rollout refuses to generate until a complete version arrives
                (the previous version serves on where the rollout held the stream aside:
                :meth:`_serves_previous_version`). Every error (a sender's too) carries a note saying which.
            DeltaBaseError: a delta stream whose base is not the intact served version (nothing was applied;
                send the version in full).
            EngineStateError: the rollout is asleep.
        """
        self._require_awake("update_weights()")
        started, applied, verifying = time.perf_counter(), False, False
        try:
            for bucket in buckets:
                self._receiver.accept(bucket)
                check_arrived(bucket)
                applied = True
                self._load_bucket(bucket)
            if self._receiver.ended:
                self._finish_update()
                self._drop_caches()
                verifying = self._verify_next or self.verify.due(self._committed)
                if verifying:
                    self._check_served()
            sync = self._sync_metrics(started, verifying)
            # NOTE: the version is recorded only now, once every bucket is applied: recorded at the last
            # bucket, a failure applying it left the failed version reported as served (and its retry stale).
            version = self._receiver.commit()
        except BaseException as e:
            # NOTE: asked before _abort_update, which forgets what the failed stream left.
            partial = applied and not self._serves_previous_version()
            if partial:
                self._unusable = (
                    f"the last update_weights() failed {'verification' if verifying else 'midway'}"
                )
            # A failed verification makes the next version verified whatever the period.
            self._verify_next = self._verify_next or verifying
            self._receiver.abort(applied=partial)
            self._abort_update()
            if isinstance(e, Exception):
                e.add_note(self._after_failure())
            raise
        self._unusable, self._verify_next, self.last_sync = None, False, sync
        self._committed += 1
        return version

    def _after_failure(self) -> str:
        """What a failed ``update_weights`` left serving, added to its error (``FAILED_KEEPS``/``FAILED_REFUSES``)."""
        if self._unusable is not None:
            return FAILED_REFUSES
        served = (
            "the weights loaded at start"
            if self.weights_version is None
            else f"version {self.weights_version}"
        )
        return f"{FAILED_KEEPS} {served} (none of the failed stream reached them), and generate() goes on with it."

    def _check_served(self) -> None:
        version = self._receiver.pending_version
        verify_served(self._receiver.manifest, self._served_tensor, version=version, rank=distributed.rank())

    def _sync_metrics(self, started: float, verified: bool) -> SyncMetrics:
        receiver = self._receiver
        total = sum(held.nbytes for held in receiver.manifest)
        return SyncMetrics(
            version=receiver.pending_version,
            delta=receiver.delta,
            bytes_sent=receiver.bytes_received,
            fraction_changed=receiver.tensor_bytes_sent / total if total else 1.0,
            seconds=time.perf_counter() - started,
            verified=verified,
        )

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig) -> RolloutOutput:
        """Sample ``sampling.n`` responses to each prompt (token ids) with the served weights.

        Raises:
            ConfigError: ``sampling.record_routed_experts`` on a rollout that does not record them.
            EngineStateError: asleep, or the last weight update failed midway (the weights are partial) or failed
                verification (they are not what was sent).
            ValueError: no prompts, or an empty prompt.
        """
        self._require_awake("generate()")
        if self._unusable is not None:
            raise EngineStateError(
                f"generate(): {self._unusable}, so the served weights are partial or wrong; hand off a complete "
                "version first."
            )
        if not prompts or any(len(prompt) == 0 for prompt in prompts):
            raise ValueError("generate() needs at least one prompt, each with at least one token.")
        recorder = self._routes_recorder(sampling)
        responses, log_probs = self._generate(prompts, sampling)
        return RolloutOutput(
            responses=responses,
            log_probs=log_probs,
            version=self.weights_version,
            n=sampling.n,
            routed_experts=recorder._take_routed_experts() if recorder is not None else None,
        )

    def _routes_recorder(self, sampling: SamplingConfig) -> RecordsRoutedExperts | None:
        """This rollout when ``sampling`` asks for routed experts, refused when it cannot record them."""
        if not sampling.record_routed_experts:
            return None
        if not isinstance(self, RecordsRoutedExperts):
            raise ConfigError(
                f"router replay (rollout.router_replay=R3) needs each token's routed experts, which the "
                f"{self.name!r} rollout ({type(self).__name__}) does not record; use rollout.name=hf or set "
                "rollout.router_replay=disabled."
            )
        return self

    def sleep(self) -> None:
        """Free device memory (weights, caches) while training uses the device; a no-op when asleep."""
        if not self._asleep:
            self._sleep()
            self._asleep = True

    def wake(self) -> None:
        """Restore what :meth:`sleep` freed; a no-op when awake."""
        if self._asleep:
            self._wake()
            self._asleep = False

    def _require_awake(self, what: str) -> None:
        if self._asleep:
            raise EngineStateError(f"{what}: the rollout is asleep; call rollout.wake() first.")

    # ------------------------------------------------------------------ backend hooks

    @abstractmethod
    def _load_bucket(self, bucket: WeightBucket) -> None:
        """Apply one bucket's tensors (``bucket.tensors()`` are views: copy them into the served weights)."""

    @abstractmethod
    def _finish_update(self) -> None:
        """After the last bucket: check that the stream covered the model, apply what was held back."""

    @abstractmethod
    def _abort_update(self) -> None:
        """Forget what a failed stream left (what it covered, what it held back): the next stream starts clean."""

    def _serves_previous_version(self) -> bool:
        """Asked when a stream failed after its first bucket was handed to :meth:`_load_bucket` (before
        :meth:`_abort_update`): whether the previous version still serves, exactly, because the rollout held
        what arrived aside and puts a version in place only whole (vLLM adding an adapter version). Then
        ``generate`` goes on with it, and a delta may still build on it.

        The default, false, is right for a rollout that loads weights in place as they arrive: the failed
        stream's part is served, so ``generate`` is refused until a complete version arrives.
        """
        return False

    def _drop_caches(self) -> None:  # noqa: B027 - a rollout that keeps no cache has nothing to drop
        """Drop everything kept across ``generate`` calls that was computed from the previous weights: a prefix
        cache's KV blocks, graphs or buffers that captured weight values. ``update_weights`` calls it once a
        new version's weights are all in place (after :meth:`_finish_update`), before they are verified and
        served; a failed stream needs no call: it left the previous weights serving, or generation is refused.

        The default drops nothing, for a rollout that keeps nothing across requests. One that does must
        override it: a prompt seen before the hand-off would otherwise be answered from the old weights'
        cache (the kit's ``test_a_prompt_seen_before_a_hand_off_is_sampled_with_the_new_weights``).
        """

    @abstractmethod
    def _served_tensor(self, name: str) -> torch.Tensor | None:
        """The tensor served under the stream name ``name``, read back from the model after every layout
        transform was undone (a fused QKV split, vocabulary padding cut, an adapter as it is bound), in any
        dtype (core casts it to the stream's); ``None`` when nothing is served under that name."""

    @abstractmethod
    def _generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Responses and their per-token log-probs, prompt-major (see :class:`RolloutOutput`)."""

    @abstractmethod
    def _sleep(self) -> None: ...

    @abstractmethod
    def _wake(self) -> None: ...


FAILED_KEEPS = "The rollout still serves"
"""How the note on a failed ``update_weights``'s error begins when the previous version serves on."""
FAILED_REFUSES = (
    "The served weights are partial (part of a failed stream reached them), so the rollout refuses to generate "
    "until a complete version arrives."
)
"""The note on a failed ``update_weights``'s error when part of the stream reached the served weights."""


def end_of_sequence_ids(config: Any, generation_config: Any) -> tuple[int, ...]:
    """Every end-of-sequence id the model config and its generation config name (each an int, a list or
    ``None``), in order of first mention."""
    ids: list[int] = []
    for value in (config.eos_token_id, getattr(generation_config, "eos_token_id", None)):
        for token in [value] if isinstance(value, int) else list(value or []):
            if token not in ids:
                ids.append(int(token))
    return tuple(ids)


def create_rollout(
    name: str,
    *,
    model_path: str,
    device: str = "cpu",
    verify: VerifyConfig | None = None,
    options: Mapping[str, Any] | RolloutOptions | None = None,
) -> Rollout:
    """Build the rollout registered under ``name`` by an installed plugin (``verify``: see :class:`Rollout`;
    ``options``: its own options, see :func:`rollout_options`).

    Raises:
        PluginError: no rollout of that name (the message lists the registered ones and the install command).
        ConfigError: ``options`` the rollout does not accept (as :func:`rollout_options`).
    """
    from ._plugins import plugins

    cls: type[Rollout] = plugins().rollouts.get(name)
    built = rollout_options(name, options)
    # NOTE: a rollout that declares no options is built as before options existed: its constructor need not
    # take them.
    declared: dict[str, Any] = {} if cls.options_class is RolloutOptions else {"options": built}
    return cls(model_path=model_path, device=device, verify=verify, **declared)


def rollout_options(name: str, values: Mapping[str, Any] | RolloutOptions | None) -> RolloutOptions:
    """The options ``values`` (plain values by key, as a job's ``rollout.options``) of the rollout registered
    under ``name``, built as its ``options_class`` and checked; a job calls it before its warm start, so a
    mistake is named before minutes of work.

    Raises:
        PluginError: no rollout of that name.
        ConfigError: an option the rollout does not declare, or a value of the wrong type or range (naming the
            rollout, its distribution, each option it accepts with type and default, and the fix).
    """
    from ._plugins import plugins

    registry = plugins().rollouts
    cls: type[Rollout] = registry.get(name)
    return build_rollout_options(cls.options_class, values, rollout=name, provider=registry.provider(name))


__all__ = [
    "Rollout",
    "RolloutOptions",
    "RolloutOutput",
    "SamplingConfig",
    "create_rollout",
    "end_of_sequence_ids",
    "rollout_options",
]

"""The ``Rollout`` contract: an inference engine that takes weights from training and samples responses.

Rollouts are plugins (``register_rollouts``), so an inference backend (vLLM, SGLang) is a separate install;
drivetrain-roles ships the Hugging Face ``generate`` one (``hf``). Public methods own the checks (template
method): a rollout serves only complete, newer weight versions (:class:`~.handoff.BucketReceiver`), refuses
to generate while asleep or while an update is partial, and answers with the version its weights come from.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from .config import ConfigError
from .errors import EngineStateError
from .handoff import BucketReceiver, WeightBucket


@dataclass(kw_only=True, frozen=True)
class SamplingConfig:
    """How responses are sampled.

    Attributes:
        n: responses per prompt.
        temperature: logits are divided by it before sampling; 0 decodes greedily.
        max_new_tokens: most tokens of one response (the end-of-sequence token included).
        seed: seed of the sampling; one ``generate`` call with the same seed, weights and prompts repeats.
    """

    n: int = 1
    temperature: float = 1.0
    max_new_tokens: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        if self.n < 1 or self.max_new_tokens < 1:
            raise ConfigError(
                f"sampling needs n >= 1 and max_new_tokens >= 1, got {self.n}, {self.max_new_tokens}."
            )
        if self.temperature < 0:
            raise ConfigError(f"sampling temperature must be >= 0 (0 is greedy), got {self.temperature}.")


@dataclass(frozen=True)
class RolloutOutput:
    """Responses to ``P`` prompts, ``n`` each, prompt-major: response ``i`` answers prompt ``i // n``.

    Attributes:
        responses: token ids of each response (up to and including the end-of-sequence token, if sampled).
        log_probs: float32 log-probability of each response token under the served weights, at the sampling
            temperature (temperature 1 for greedy decoding), same lengths as ``responses``.
        version: the weight version that produced them (``None``: the weights loaded at construction).
        n: responses per prompt.
    """

    responses: list[torch.Tensor]
    log_probs: list[torch.Tensor]
    version: int | None
    n: int


class Rollout(ABC):
    """A generation engine that receives weight buckets from a training engine.

    Args:
        model_path: the Hugging Face model directory whose architecture (and initial weights) it serves.
        device: where it runs (``cpu``, ``cuda``).
    """

    name: ClassVar[str] = ""
    """The name the rollout registers under (``hf``)."""

    def __init__(self, *, model_path: str, device: str = "cpu") -> None:
        self.model_path = model_path
        self.device = device
        self._receiver = BucketReceiver()
        self._asleep = False
        self._partial = False

    @property
    def weights_version(self) -> int | None:
        """The version of the served weights (``None``: as loaded from ``model_path``)."""
        return self._receiver.version

    @property
    def asleep(self) -> bool:
        return self._asleep

    def update_weights(self, buckets: Iterable[WeightBucket]) -> int:
        """Load one complete hand-off (``engine.weight_buckets(...)``), bucket by bucket.

        Returns:
            The new weight version.

        Raises:
            HandoffError: a bucket is stale, reordered or from another stream, the stream ended before its
                last bucket, or the weights do not fit the served model; the rollout then refuses to generate
                until a complete version arrives.
            EngineStateError: the rollout is asleep.
        """
        self._require_awake("update_weights()")
        self._partial = True
        try:
            for bucket in buckets:
                self._receiver.accept(bucket)
                self._load_bucket(bucket)
            if self._receiver.ended:
                self._finish_update()
            # NOTE: the version is recorded only now, once every bucket is applied: recorded at the last
            # bucket, a failure applying it left the failed version reported as served (and its retry stale).
            version = self._receiver.commit()
        except BaseException:
            self._receiver.abort()
            self._abort_update()
            raise
        self._partial = False
        return version

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig) -> RolloutOutput:
        """Sample ``sampling.n`` responses to each prompt (token ids) with the served weights.

        Raises:
            EngineStateError: asleep, or the last weight update failed midway (the weights are partial).
            ValueError: no prompts, or an empty prompt.
        """
        self._require_awake("generate()")
        if self._partial:
            raise EngineStateError(
                "generate(): the last update_weights() failed midway, so the served weights are partial; hand "
                "off a complete version first."
            )
        if not prompts or any(len(prompt) == 0 for prompt in prompts):
            raise ValueError("generate() needs at least one prompt, each with at least one token.")
        responses, log_probs = self._generate(prompts, sampling)
        return RolloutOutput(
            responses=responses, log_probs=log_probs, version=self.weights_version, n=sampling.n
        )

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

    @abstractmethod
    def _generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Responses and their per-token log-probs, prompt-major (see :class:`RolloutOutput`)."""

    @abstractmethod
    def _sleep(self) -> None: ...

    @abstractmethod
    def _wake(self) -> None: ...


def create_rollout(name: str, *, model_path: str, device: str = "cpu") -> Rollout:
    """Build the rollout registered under ``name`` by an installed plugin.

    Raises:
        PluginError: no rollout of that name (the message lists the registered ones and the install command).
    """
    from .plugins import plugins

    cls = plugins().rollouts.get(name)
    return cls(model_path=model_path, device=device)


__all__ = ["Rollout", "RolloutOutput", "SamplingConfig", "create_rollout"]

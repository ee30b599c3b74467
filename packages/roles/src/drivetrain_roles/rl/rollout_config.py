"""The ``rollout`` section of ``drivetrain grpo`` (and, with fewer responses per prompt, ``drivetrain ppo``): how
responses are sampled and handed the new weights."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from drivetrain_engine_core.backend import ConfigError
from drivetrain_engine_core.rollout import SamplingConfig

from .router_replay import RouterReplayOption

LoraHandoff = Literal["merged", "adapter"]
"""What a hand-off of a LoRA model sends: core's ``handoff.LoraMode``, written here because the config loads without
torch (``handoff`` imports it; the CLI prints configs torch-free)."""


@dataclass(kw_only=True, frozen=True)
class RolloutConfig(RouterReplayOption):
    """How responses are sampled (and whether routed experts are recorded: :class:`RouterReplayOption`).

    Attributes:
        name: the registered rollout backend (``hf``: Hugging Face ``generate``; see ``drivetrain plugins``).
        n: responses per prompt (the group whose rewards are normalised together).
        temperature: sampling temperature (> 0); the actor's and reference's log-probs use the same one.
        top_k: sample among the ``top_k`` likeliest tokens only (verl's and vLLM's ``top_k``; 0: all, verl's -1).
        top_p: sample among the likeliest tokens whose probabilities sum to ``top_p`` (1: all).
        min_p: drop tokens less likely than ``min_p`` times the likeliest one (0: none).
        max_new_tokens: most tokens of one response.
        bucket_mb: the weight hand-off's bucket size in MiB.
        lora_handoff: with ``model.lora``, what a hand-off sends: ``merged`` (the full weights, the adapters
            folded in) or ``adapter`` (the adapters alone, far fewer bytes, served over the rollout's base
            weights: ``hf``; ``vllm``/``vllm-server`` with ``rollout.options.enable_lora=true``, an adapter per
            version, ``rollout.options.max_loras`` of them kept: unset, as many as the trainer samples from at once,
            ``trainer.max_staleness + 1`` when asynchronous).
        options: the chosen rollout's own options, ``rollout.options.<key>=<value>`` (verl's
            ``rollout.engine_kwargs``): each rollout plugin declares which keys it takes, with their types and
            defaults (``vllm``: ``gpu_memory_utilization``, ``max_model_len``, ...; ``vllm-server`` also
            ``request_timeout_s``; ``hf``: none); checked against the plugin on every rank before the warm start.

    With ``top_k``/``top_p``/``min_p`` the rollout samples from the truncated, renormalised distribution and
    reports its log-probs, while the actor's are of the full one at the temperature (as in verl and TRL): the
    policy ratio and ``rollout/log_prob_diff_max`` then include the truncation.
    """

    name: str = "hf"
    n: int = 8
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    max_new_tokens: int = 6
    bucket_mb: float = 64.0
    lora_handoff: LoraHandoff = "merged"
    options: dict[str, Any] = field(default_factory=dict)

    least_n: ClassVar[tuple[int, str]] = (2, "GRPO compares responses to one prompt")
    """The fewest responses per prompt the command can learn from, and why."""

    def __post_init__(self) -> None:
        least, why = self.least_n
        if self.n < least:
            raise ConfigError(f"rollout.n must be >= {least} ({why}), got {self.n}.")
        if not self.temperature > 0:
            raise ConfigError(f"rollout.temperature must be > 0 (GRPO samples), got {self.temperature}.")
        if self.max_new_tokens < 1 or not self.bucket_mb > 0:
            raise ConfigError("rollout.max_new_tokens must be >= 1 and rollout.bucket_mb > 0.")
        try:
            self.sampling(seed=0)
        except ConfigError as e:
            raise ConfigError(f"rollout.top_k/top_p/min_p: {e} Set them in those ranges.") from e

    def sampling(self, *, seed: int) -> SamplingConfig:
        """One step's sampling: ``n`` responses per prompt at the temperature, truncated as set."""
        return SamplingConfig(
            n=self.n,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
            max_new_tokens=self.max_new_tokens,
            seed=seed,
        )

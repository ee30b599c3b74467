"""How a rollout samples responses: :class:`SamplingConfig`, the argument of ``Rollout.generate``.

Imports no torch: commands check their sampling options when their config is built (``--help-config`` and
``--print-config`` among them); :mod:`.rollout` exports it beside the contract.
"""

from __future__ import annotations

from dataclasses import dataclass

from ._config import ConfigError


@dataclass(kw_only=True, frozen=True)
class SamplingConfig:
    """How responses are sampled.

    Attributes:
        n: responses per prompt.
        temperature: logits are divided by it before sampling; 0 decodes greedily.
        max_new_tokens: most tokens of one response (the end-of-sequence token included).
        seed: seed of the sampling; one ``generate`` call with the same seed, weights and prompts repeats.
        top_k: sample among the ``top_k`` likeliest tokens only (0: all).
        top_p: sample among the likeliest tokens whose probabilities sum to ``top_p`` (1: all).
        min_p: drop tokens less likely than ``min_p`` times the likeliest one (0: none).
        stop_token_ids: a response also ends after any of these tokens (beside the model's end-of-sequence).
        record_routed_experts: also return each token's routed experts (router replay, R3; a mixture-of-experts
            model on a rollout that records them, :class:`RecordsRoutedExperts`).

    The returned log-probs are of the distribution sampled from: after temperature, ``top_k``, ``top_p`` and
    ``min_p`` (a token they removed is never sampled). The actor's log-probs are of the full distribution at
    the temperature, so truncation makes the two differ by design.
    """

    n: int = 1
    temperature: float = 1.0
    max_new_tokens: int = 16
    seed: int = 0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    stop_token_ids: tuple[int, ...] = ()
    record_routed_experts: bool = False

    def __post_init__(self) -> None:
        if self.n < 1 or self.max_new_tokens < 1:
            raise ConfigError(
                f"sampling needs n >= 1 and max_new_tokens >= 1, got {self.n}, {self.max_new_tokens}."
            )
        if self.temperature < 0:
            raise ConfigError(f"sampling temperature must be >= 0 (0 is greedy), got {self.temperature}.")
        if self.top_k < 0 or not 0 < self.top_p <= 1 or not 0 <= self.min_p <= 1:
            raise ConfigError(
                f"sampling needs top_k >= 0 (0: off), 0 < top_p <= 1 and 0 <= min_p <= 1, got top_k={self.top_k}, "
                f"top_p={self.top_p}, min_p={self.min_p}."
            )

    @property
    def truncates(self) -> bool:
        """Whether ``top_k``, ``top_p`` or ``min_p`` remove tokens from the tempered distribution."""
        return self.top_k > 0 or self.top_p < 1 or self.min_p > 0


__all__ = ["SamplingConfig"]

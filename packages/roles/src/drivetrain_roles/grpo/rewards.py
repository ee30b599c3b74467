"""GRPO's reward and advantages: exact-answer rewards, normalised within each prompt's group of responses."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def exact_match(answer: str, reference: str) -> bool:
    """Whether a decoded answer, stripped of surrounding spaces, equals the reference answer stripped."""
    return answer.strip() == reference.strip()


def exact_answer_rewards(answers: Sequence[str], references: Sequence[str]) -> torch.Tensor:
    """``(len(answers),)`` float32: 1 where the answer is exactly the reference, else 0."""
    return torch.tensor(
        [float(exact_match(a, r)) for a, r in zip(answers, references, strict=True)], dtype=torch.float32
    )


def group_advantages(rewards: torch.Tensor, group_size: int, epsilon: float = 1e-6) -> torch.Tensor:
    """GRPO's outcome advantage: each reward minus its group's mean, over the group's standard deviation.

    Args:
        rewards: ``(groups * group_size,)`` rewards, group-major (the ``n`` responses of a prompt together).
        group_size: responses per prompt.
        epsilon: added to the (unbiased) standard deviation; a group whose rewards are all equal gets 0.

    Returns:
        Advantages of the same shape; with one response per prompt, the rewards themselves (verl's mean 0 and
        standard deviation 1 for a group of one, whose unbiased deviation is NaN).
    """
    if group_size == 1:
        return rewards.clone()
    grouped = rewards.reshape(-1, group_size)
    mean = grouped.mean(dim=1, keepdim=True)
    std = grouped.std(dim=1, keepdim=True)
    return ((grouped - mean) / (std + epsilon)).reshape(-1)

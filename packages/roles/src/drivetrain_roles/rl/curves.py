"""What a policy-gradient run's curve shows (grpo; ppo adds a panel): reward, accuracy, KL, rollout gap; below them
each reward entry's own values."""

from __future__ import annotations

from collections.abc import Sequence

from ..jobs.curves import Curves, Panel, Series

POLICY_CURVES = Curves(
    (
        Panel(
            title="reward per completion ({reward})",
            series=(
                Series(key="train/reward", label="train"),
                Series(key="val/reward", label="held-out", style="o-"),
            ),
        ),
        Panel(
            title="held-out accuracy: greedy answer equals the reference",
            series=(Series(key="val/accuracy", label="held-out exact match", style="s-"),),
            fraction=True,
        ),
        Panel(title="KL(actor || reference) per token", series=(Series(key="train/kl", label="train"),)),
        Panel(
            title="rollout vs actor log-probs of the sampled tokens",
            series=(
                Series(key="rollout/mismatch_kl", label="mismatch KL per token"),
                Series(key="rollout/log_prob_diff_max", label="largest |log-prob gap|", style=":"),
            ),
        ),
    )
)
"""Reward (train and held-out), held-out exact match, the KL to the reference and the rollout/actor gap."""


def reward_entries_panel(names: Sequence[str]) -> Panel:
    """The panel of each ``algorithm.reward_functions`` entry: ``reward/<name>`` per step and ``val/reward/<name>``
    per evaluation, unweighted (the reward panel above shows their weighted sum)."""
    series = tuple(
        line
        for name in names
        for line in (
            Series(key=f"reward/{name}", label=f"{name} (train)"),
            Series(key=f"val/reward/{name}", label=f"{name} (held-out)", style="o-"),
        )
    )
    return Panel(title="each reward function, unweighted (algorithm.reward_functions)", series=series)

"""Which held-out measure an SFT run's report leads with: exact match for exact answers, the loss otherwise.

Exact match of a greedy answer says whether a model learnt a task whose references are the only right answers
(the embedded arithmetic: ``12+7=`` -> ``19``). A chat reference is one good answer among many: a model that
learnt the data well answers otherwise and reads 0%, so the held-out loss (and its perplexity) leads, exact
match beside it. The data's kind decides: chat messages are open-ended, prompt/response pairs exact.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any

from ..command_sections import DataConfig
from ..jobs.curves import Curves, Panel, Series, train_and_held_out

REPORT_KEYS = ("val/loss", "val/perplexity", "val/accuracy")
"""Every held-out measure of an SFT evaluation, in the report's order after the headline."""

CURVES = Curves(
    (
        Panel(
            title="SFT loss: cross-entropy of the response tokens ({loss_agg_mode})",
            series=train_and_held_out("loss"),
            log_scale=True,
        ),
        Panel(
            title="held-out perplexity, exp(held-out loss)",
            series=(Series(key="val/perplexity", label="held-out", style="o-"),),
            log_scale=True,
        ),
        Panel(
            title="held-out accuracy: greedy answer equals the reference",
            series=(Series(key="val/accuracy", label="held-out exact match", style="s-"),),
            fraction=True,
        ),
    )
)
"""What an SFT run's curve shows: the loss, its perplexity and exact match."""

PER_TOKEN_MODES = ("token-mean", "seq-mean-token-mean")
"""The loss aggregations whose held-out loss is a mean per token, so its exponential is a perplexity."""

MAX_EXP = math.log(sys.float_info.max)
"""The largest loss whose exponential is a finite float."""


@dataclass(frozen=True)
class Headline:
    """The measure the report and ``summary.json`` lead with, and why."""

    metric: str
    reason: str

    def report_keys(self) -> tuple[str, ...]:
        """The held-out measures in the report's order: the headline first."""
        return (self.metric, *(key for key in REPORT_KEYS if key != self.metric))

    def summary(self, evaluations: list[dict[str, float]]) -> dict[str, Any]:
        """``summary.json``'s ``headline``: the metric, its value at the last evaluation (``None`` without one)
        and why it leads."""
        value = evaluations[-1].get(self.metric) if evaluations else None
        return {"metric": self.metric, "value": value, "reason": self.reason}


def headline(data: DataConfig) -> Headline:
    """The headline of a run on ``data``: the loss for chat messages, exact match for prompt/response pairs."""
    if data.messages_key is not None:
        return Headline(
            "val/loss",
            f"chat data (data.messages_key={data.messages_key}) has open-ended references: the held-out loss "
            "leads, exact match of greedy answers (val/accuracy) is a side measure",
        )
    return Headline(
        "val/accuracy", "prompt/response data has exact answers: exact match of greedy answers leads"
    )


def perplexity(loss: float, loss_agg_mode: str) -> dict[str, float]:
    """``val/perplexity``, ``exp(val/loss)``, where the held-out loss is a per-token mean (``PER_TOKEN_MODES``);
    empty under ``seq-mean-token-sum``, whose loss sums each sequence's tokens. A diverged loss past
    ``exp``'s range (709 nats) reads ``inf``."""
    if loss_agg_mode not in PER_TOKEN_MODES:
        return {}
    return {"val/perplexity": math.inf if loss >= MAX_EXP else math.exp(loss)}

"""What a reward function receives: keywords, each a list with one entry per completion, prompt-major (the ``n``
completions of a prompt together).

- ``prompts``: the prompt texts, as the policy saw them (a chat prompt rendered by the template).
- ``completions``: the decoded completions.
- ``completion_messages``: each completion as a conversation of one assistant turn (TRL's ``completions`` for
  conversational data: ``[{"role": "assistant", "content": ...}]``).
- ``completion_ids``: each completion's token ids (TRL's ``completion_ids``).
- ``references``: the reference answers (``data.response_key``, or a conversation's last assistant turn);
  absent when the data has none (``data.response_key=null``).
- ``trajectory``: in a multi-turn job (``environment.name``), each episode as it went
  (:class:`~drivetrain_roles.rollout.trajectory.Trajectory`): ``messages`` (the conversation: the first prompt,
  each model turn as an ``assistant`` message with its ``tool_calls``, each observation), ``turn_rewards`` (what
  the environment gave each model turn), ``stop_reason``, ``infos`` and the token ids; ``completions`` is then the
  final model turn. Absent in single-turn jobs.
- every column of the data set, by its name, as TRL passes its extra columns (``answer``, verl's
  ``data_source``, ``reward_model``, ``extra_info``); a column named like one of the keywords above is
  shadowed by it.

A function gets the keywords its signature names, or all of them when it takes ``**kwargs``
(:mod:`.reward_signatures`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..jobs.data import Example
    from ..rollout.trajectory import Trajectory

DRIVETRAIN_KEYWORDS = ("prompts", "completions", "completion_messages", "completion_ids", "references")
"""The keywords drivetrain computes (the data set's columns come beside them)."""
TRAJECTORY = "trajectory"
"""The keyword of a multi-turn job's episodes (beside :data:`DRIVETRAIN_KEYWORDS`; shadows a column so named)."""


@dataclass(frozen=True)
class RewardInputs:
    """A batch's keywords and where each completion's row comes from.

    Attributes:
        keywords: keyword -> one value per completion.
        sources: per completion, its data set row (``train.jsonl row 3``), or ``""`` when unknown.
    """

    keywords: Mapping[str, Sequence[Any]]
    sources: Sequence[str]

    @classmethod
    def of(
        cls,
        examples: Sequence[Example],
        completions: Sequence[str],
        completion_ids: Sequence[Sequence[int]] | None = None,
        trajectories: Sequence[Trajectory] | None = None,
    ) -> RewardInputs:
        """The keywords of ``completions`` (``len(completions) // len(examples)`` per example, prompt-major);
        ``trajectories``: the episodes whose final turns they are (a multi-turn job's)."""
        n = len(completions) // max(len(examples), 1)
        rows = [examples[i // n] for i in range(len(completions))]
        keywords: dict[str, Sequence[Any]] = {
            column: [row.columns[column] for row in rows] for column in shared_columns(examples)
        }
        keywords.update(_drivetrain_keywords([row.prompt_text for row in rows], completions))
        if completion_ids is not None:
            keywords["completion_ids"] = [list(ids) for ids in completion_ids]
        if all(example.has_reference for example in examples):
            keywords["references"] = [row.response_text for row in rows]
        if trajectories is not None:
            keywords[TRAJECTORY] = list(trajectories)
        return cls(keywords=keywords, sources=[row.source for row in rows])

    @classmethod
    def of_texts(
        cls, prompts: Sequence[str], completions: Sequence[str], references: Sequence[str] | None = None
    ) -> RewardInputs:
        """The keywords of texts alone (no data set row, no token ids)."""
        keywords = dict(_drivetrain_keywords(prompts, completions))
        if references is not None:
            keywords["references"] = list(references)
        return cls(keywords=keywords, sources=[""] * len(completions))

    def __len__(self) -> int:
        return len(self.keywords["completions"])

    def take(self, rows: Sequence[int]) -> RewardInputs:
        """The inputs of the completions ``rows``, in that order."""
        return RewardInputs(
            keywords={k: [v[i] for i in rows] for k, v in self.keywords.items()},
            sources=[self.sources[i] for i in rows],
        )

    def describe(self, row: int) -> str:
        """Completion ``row`` in words for an error: its data set row, the prompt's end and the completion."""
        prompt = str(self.keywords["prompts"][row])[-60:]
        completion = str(self.keywords["completions"][row])[:60]
        where = f"{self.sources[row]}, " if self.sources[row] else ""
        return f"completion {row} ({where}prompt ...{prompt!r}, completion {completion!r}...)"


def shared_columns(examples: Sequence[Example]) -> list[str]:
    """The data set columns every example has (in the first's order), without those a keyword shadows."""
    if not examples:
        return []
    return [
        column
        for column in examples[0].columns
        if column not in DRIVETRAIN_KEYWORDS and all(column in example.columns for example in examples)
    ]


def available_keywords(examples: Sequence[Example], *, episodes: bool = False) -> list[str]:
    """The keywords a batch of ``examples`` offers: drivetrain's (``references`` where they have them,
    ``trajectory`` with ``episodes``) and their shared columns."""
    ours = [k for k in DRIVETRAIN_KEYWORDS if k != "references" or all(e.has_reference for e in examples)]
    if episodes:
        ours.append(TRAJECTORY)
    return ours + [c for c in shared_columns(examples) if c not in ours]


def _drivetrain_keywords(prompts: Sequence[str], completions: Sequence[str]) -> dict[str, Sequence[Any]]:
    return {
        "prompts": list(prompts),
        "completions": list(completions),
        "completion_messages": [[{"role": "assistant", "content": c}] for c in completions],
    }

"""The reward-model role: one number per completion from a sequence-classification model on its own engine.

The engine is a value model (``model.model_type="value_model"``: the ``*ForTokenClassification`` layout, which
a ``*ForSequenceClassification`` folder fills, both heads being ``score``), run forward only on a no-padding
batch in the engine's micro-batches, like the reference and the critic. A sequence-classification model's
score is its head at the last token; the value at a position is the head read at the position before
(ARCHITECTURE §7.1), so each sequence gets one readout token appended and its value is the score, as
``drivetrain rm`` trains it. In a multi-turn job each episode is scored whole (:mod:`.render`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from drivetrain_engine_core.backend import DrivetrainError, Engine
from drivetrain_engine_core.job import make_batch

from ..rl.reward_inputs import TRAJECTORY
from ..rollout.trajectory import Trajectory
from .render import PromptColumns, chat_ids, prompt_messages, scored_ids


class RewardModel:
    """Scores completions with a sequence-classification model on ``engine`` (collective: every data-parallel
    rank calls :meth:`score_ids` with its own sequences).

    Args:
        engine: an initialised value-model engine of the reward model's folder.
        tokenizer: the reward model's tokenizer (its chat template renders the conversations).
        data: the job's ``data`` options (where a row's prompt messages are).
        pad_token_id: the reward model's ``pad_token_id`` (trailing ones are not scored, as in Hugging Face).
    """

    def __init__(self, engine: Engine, tokenizer: Any, data: PromptColumns, pad_token_id: int | None) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.data = data
        self.pad_token_id = pad_token_id
        self.readout_token = next((t for t in (pad_token_id, tokenizer.eos_token_id) if t is not None), 0)

    def __call__(self, **keywords: Sequence[Any]) -> list[float]:
        """The reward function: each completion's score, its conversation rendered for the reward model (in a
        multi-turn job its whole episode, :mod:`.render`)."""
        return self.score_ids(self.sequences(keywords)).tolist()

    def sequences(self, keywords: Mapping[str, Sequence[Any]]) -> list[list[int]]:
        """The reward model's tokens of each completion's conversation: the episode's messages where
        ``keywords`` hold a multi-turn job's episodes (``trajectory``), else the row's prompt and the completion.
        """
        episodes = keywords.get(TRAJECTORY)
        if episodes is not None and all(isinstance(e, Trajectory) for e in episodes):
            # NOTE: checked by type: in a single-turn job a data column may be named ``trajectory``.
            return [chat_ids(self.tokenizer, e.messages, pad_token_id=self.pad_token_id) for e in episodes]
        prompts, completions = keywords["prompts"], keywords["completions"]
        return [
            scored_ids(
                self.tokenizer,
                str(prompts[row]),
                prompt_messages(_row(keywords, row), self.data),
                str(completions[row]),
                pad_token_id=self.pad_token_id,
            )
            for row in range(len(completions))
        ]

    def score_ids(self, sequences: Sequence[Sequence[int]]) -> torch.Tensor:
        """``(len(sequences),)`` float32: the model's score of each token sequence.

        Raises:
            DrivetrainError: this rank holds no outputs (model parallelism without outputs on every rank).
        """
        batch = make_batch([torch.tensor([*ids, self.readout_token], dtype=torch.long) for ids in sequences])
        with self.engine.eval_mode():
            outputs = self.engine.infer_batch(batch).outputs
        if outputs is None:
            raise DrivetrainError(
                "the reward model's engine returned no values on this rank; run it with data parallelism only."
            )
        values = outputs["values"]
        return values.values()[values.offsets()[1:] - 1].detach().float().cpu()


def _row(keywords: Mapping[str, Sequence[Any]], row: int) -> dict[str, Any]:
    return {key: value[row] for key, value in keywords.items()}

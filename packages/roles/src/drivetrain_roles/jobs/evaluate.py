"""Held-out evaluation: the SFT loss through the engine, and exact-match accuracy of greedy answers.

Accuracy needs generation, which the Engine contract does not offer (``infer_batch`` returns log-probs
only). Every rank streams ``engine.export_weights()`` (full tensors, adapters merged); the output rank loads
them into a plain Hugging Face model and decodes greedily with ``generate``, up to the EOS or the chat
template's turn end. An answer is correct when the decoded response, stripped of special tokens and surrounding
spaces, equals the reference response. This checks what a user of the trained model would see, whatever the
backend, at the cost of one weight export per evaluation (fine for the sizes this trainer targets on CPU).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from drivetrain_engine_core.backend import Engine
from drivetrain_engine_core.job import LossFn
from drivetrain_engine_core.kit import distributed

from .batches import make_sft_batch
from .data import Example
from .final_model import gather_hf_model
from .progress import generation_progress
from .stop_tokens import stop_token_ids


def held_out_loss(engine: Engine, examples: Sequence[Example], loss_fn: LossFn) -> float:
    """The SFT loss of ``examples`` (split over data-parallel ranks), without gradients."""
    rank, size = engine.data_parallel_rank, engine.data_parallel_size
    with engine.eval_mode():
        output = engine.infer_batch(make_sft_batch(examples[rank::size]), loss_fn)
    return float(output.loss)  # type: ignore[arg-type]


AnswerMeasures = Callable[[Sequence[Example], Sequence[str]], dict[str, float]]
"""``measures(examples, answers) -> {"val/<name>": value}``: more measures of the greedy answers."""


def greedy_accuracy(
    engine: Engine,
    examples: Sequence[Example],
    tokenizer: Any,
    *,
    max_new_tokens: int,
    model_path: str,
    progress: bool = False,
) -> float:
    """Fraction of ``examples`` whose greedy answer equals the reference (collective; every rank gets it);
    ``progress`` shows the generation's bar (:func:`~.progress.generation_progress`)."""
    values = greedy_evaluation(
        engine, examples, tokenizer, max_new_tokens=max_new_tokens, model_path=model_path, progress=progress
    )
    return values["val/accuracy"]


def greedy_evaluation(
    engine: Engine,
    examples: Sequence[Example],
    tokenizer: Any,
    *,
    max_new_tokens: int,
    model_path: str,
    progress: bool = False,
    measures: AnswerMeasures | None = None,
) -> dict[str, float]:
    """``val/accuracy`` (exact match) of the greedy answers to ``examples`` and ``measures``' values of them,
    measured on the output rank (collective; every rank gets them)."""
    model = gather_hf_model(engine, model_path)
    values: dict[str, float] = {}
    if model is not None:
        answers = generate_answers(
            model, examples, tokenizer, max_new_tokens=max_new_tokens, progress=progress
        )
        correct = sum(a.strip() == e.response_text.strip() for a, e in zip(answers, examples, strict=True))
        values["val/accuracy"] = correct / len(examples)
        if measures is not None:
            values.update(measures(examples, answers))
    return dict(distributed.broadcast_object(values))  # type: ignore[call-overload]


@torch.no_grad()
def generate_answers(
    model: Any, examples: Sequence[Example], tokenizer: Any, *, max_new_tokens: int, progress: bool = False
) -> list[str]:
    """Greedy responses to the examples' prompts (left-padded into one batch), each up to its first stop token
    (:func:`~.stop_tokens.stop_token_ids`), decoded without special tokens; ``progress`` counts the new tokens
    on a bar."""
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    width = max(len(e.prompt_ids) for e in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, example in enumerate(examples):
        input_ids[row, width - len(example.prompt_ids) :] = torch.tensor(example.prompt_ids)
        attention_mask[row, width - len(example.prompt_ids) :] = 1
    with generation_progress(max_new_tokens, enabled=progress) as bar:
        generated = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=pad_id,
            eos_token_id=stop_token_ids(tokenizer) or None,
            stopping_criteria=[_CountTokens(bar)],
        )
    return tokenizer.batch_decode(generated[:, width:], skip_special_tokens=True)


class _CountTokens:
    """A stopping criterion that never stops: ``generate`` calls it once per new token, and it moves the bar.

    NOTE: the one per-step callback ``generate`` offers every model; a streamer sees the tokens of one row only.
    """

    def __init__(self, bar: Any) -> None:
        self.bar = bar

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        self.bar.update(1)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

"""Preference pairs: files of prompt/chosen/rejected (or chat conversations), tokenised like SFT examples.

Each side of a pair is an SFT :class:`~drivetrain_roles.jobs.data.Example` (bos + prompt, then response + eos,
or a chat conversation split before its last assistant turn), so a pair trains on exactly the tokens
``drivetrain sft`` would, and the warm start can train on the chosen side as it is. Problems are found before
training and reported once with the file, row and fix.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..jobs.data import (
    DataError,
    Example,
    OverlongRows,
    column,
    read_options,
    read_rows,
    text_value,
    tokenize_messages,
    tokenize_prompt_response,
)
from .config import PairDataConfig


@dataclass(frozen=True)
class PairExample:
    """One tokenised pair: the same prompt with the preferred and the dispreferred response."""

    chosen: Example
    rejected: Example
    margin: float = 0.0
    """By how much the chosen score should exceed the rejected one (``data.margin_key``; reward models)."""


def load_pairs(
    files: Sequence[str | Path], tokenizer: Any, config: PairDataConfig, *, held_out: bool = False
) -> list[PairExample]:
    """Read, tokenise and check every pair of ``files`` (``held_out``: ``data.val_files``, read at
    ``data.val_split`` where a source has splits); with ``data.overlong=drop``, skip the over-long ones.

    Raises:
        DataError: no file or no rows, a missing column, sides with different prompts, or a sequence longer
            than ``config.max_length`` (``data.overlong=error``).
    """
    if not files:
        raise DataError(
            "no data files given; set data.train_files (with prompt/chosen/rejected columns, or data.chat "
            "conversations)."
        )
    pairs, overlong = [], OverlongRows(config.max_length, config.overlong)
    for path in files:
        for index, row in enumerate(read_rows(path, **read_options(config, held_out=held_out))):
            where = f"{path} row {index}"
            pair = tokenize_pair(row, tokenizer, config, where=where)
            if overlong.fits([pair.chosen, pair.rejected], where):
                pairs.append(pair)
    overlong.report(files, kept=len(pairs), unit="pairs")
    if not pairs:
        raise DataError(
            f"the data set {[str(f) for f in files]} is empty; give files with at least one pair."
        )
    return pairs


def tokenize_pair(row: dict[str, Any], tokenizer: Any, config: PairDataConfig, *, where: str) -> PairExample:
    """Tokenise one row: prompt + chosen/rejected texts, or two chat conversations sharing their prompt turns."""
    if config.chat:
        chosen = tokenize_messages(chat_side(row, config.chosen_key, config, where), tokenizer, where)
        rejected = tokenize_messages(chat_side(row, config.rejected_key, config, where), tokenizer, where)
        if chosen.prompt_ids != rejected.prompt_ids:
            raise DataError(
                f"{where}: the chosen and rejected conversations differ before their last assistant turn; a pair "
                "must share its prompt."
            )
        return PairExample(chosen=chosen, rejected=rejected, margin=margin_value(row, config, where))
    prompt = text_value(row, config.prompt_key, where, "data.prompt_key")
    sides = []
    for key, option in ((config.chosen_key, "data.chosen_key"), (config.rejected_key, "data.rejected_key")):
        response = text_value(row, key, where, option)
        sides.append(
            tokenize_prompt_response(
                prompt, response, tokenizer, where=where, columns=(config.prompt_key, key)
            )
        )
    return PairExample(chosen=sides[0], rejected=sides[1], margin=margin_value(row, config, where))


def margin_value(row: dict[str, Any], config: PairDataConfig, where: str) -> float:
    """The pair's margin from ``data.margin_key`` (0 without one).

    Raises:
        DataError: the row lacks the column, or it holds something other than a finite number.
    """
    if config.margin_key is None:
        return 0.0
    value = column(row, config.margin_key, where, "data.margin_key")
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise DataError(
            f"{where} column {config.margin_key!r} holds {value!r}, not a finite number; fix the row, or unset "
            "data.margin_key."
        )
    return float(value)


def chat_side(row: dict[str, Any], key: str, config: PairDataConfig, where: str) -> Any:
    """The whole conversation of one side of a chat pair (``data.chat``).

    A side that holds only assistant turns takes its prompt turns from the ``data.prompt_key`` column, as TRL's
    explicit-prompt conversational format has it (a list of messages, or a text read as one user turn); a side
    with other turns is the whole conversation (TRL's implicit prompt) and the prompt column is not read.

    NOTE: explicit-prompt rows passed the checks and then failed in transformers ("Cannot apply chat template
    to an empty conversation"), naming no row.

    Raises:
        DataError: the row lacks the side's column, or an assistant-only side has no prompt column.
    """
    option = "data.chosen_key" if key == config.chosen_key else "data.rejected_key"
    side = column(row, key, where, option)
    if not isinstance(side, list) or any(not _is_assistant_turn(m) for m in side):
        return side
    if config.prompt_key not in row:
        raise DataError(
            f"{where} column {key!r} holds only assistant turns and the row has no prompt column "
            f"{config.prompt_key!r}; give the prompt turns in a prompt column (TRL's explicit prompt; "
            "data.prompt_key=<column>) or in both conversations."
        )
    prompt = row[config.prompt_key]
    return [*([{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt), *side]


def _is_assistant_turn(message: Any) -> bool:
    return isinstance(message, dict) and message.get("role") == "assistant"


def check_pair_rows(files: Sequence[str | Path], config: PairDataConfig, *, held_out: bool = False) -> int:
    """Check that every row of ``files`` holds a pair's columns (texts, or conversations with ``data.chat``);
    returns how many rows there are.

    Run on every rank before the SFT warm start: a missing column used to surface after it (minutes to hours),
    or as a bare ``KeyError`` on rank 0 alone while it wrote the warm start's rows and the others waited.

    Raises:
        DataError: a row lacks a column, or a text column holds something else (names the row and option).
    """
    keys = [(config.chosen_key, "data.chosen_key"), (config.rejected_key, "data.rejected_key")]
    if not config.chat:
        keys.insert(0, (config.prompt_key, "data.prompt_key"))
    count = 0
    for path in files:
        for index, row in enumerate(read_rows(path, **read_options(config, held_out=held_out))):
            where = f"{path} row {index}"
            for key, option in keys:
                if config.chat:
                    chat_side(row, key, config, where)
                else:
                    text_value(row, key, where, option)
            margin_value(row, config, where)
            count += 1
    return count


def write_sft_rows(
    pairs_file: str | Path, target: Path, config: PairDataConfig, *, held_out: bool = False
) -> Path:
    """The chosen side of every pair of ``pairs_file`` as SFT rows (``prompt``/``response`` or ``messages``), each
    distinct row once (a prompt paired with several rejected answers is one SFT example)."""
    rows = []
    for row in read_rows(pairs_file, **read_options(config, held_out=held_out)):
        if config.chat:
            rows.append({"messages": chat_side(row, config.chosen_key, config, str(pairs_file))})
        else:
            rows.append({"prompt": row[config.prompt_key], "response": row[config.chosen_key]})
    lines = dict.fromkeys(json.dumps(r) + "\n" for r in rows)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text("".join(lines))
    return target

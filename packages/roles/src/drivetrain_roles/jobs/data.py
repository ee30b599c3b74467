"""SFT data: parquet or JSONL files (or Hugging Face datasets: :mod:`.dataset_rows`) of prompt/response pairs or
chat messages, tokenised with a loss on responses.

Every problem is found before training starts and reported once, naming the file, the row and the fix: an
unreadable file (not UTF-8, corrupt parquet), a line that is not a JSON object, a missing column, a value that
is not text, characters the tokenizer does not know, an empty data set, a response that leaves no room in the
token budget.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from drivetrain_engine_core.backend import DrivetrainError
from drivetrain_engine_core.kit import distributed

from ..command_sections import DataConfig
from .dataset_rows import SUPPORTED_SOURCES, dataset_rows, is_dataset_source
from .token_coverage import encode_with_unknown

logger = logging.getLogger(__name__)


class DataError(DrivetrainError, ValueError):
    """The SFT data cannot be used as configured; the message names the file, row or column and the fix."""


@dataclass(frozen=True)
class Example:
    """One tokenised example: the prompt tokens (no loss) followed by the response tokens (loss).

    ``earlier_turn_spans`` are the ``[start, end)`` ranges of ``prompt_ids`` that hold the earlier assistant turns
    of a multi-turn conversation, trained on as well (``data.assistant_turns=all``); the response is always the
    last assistant turn, which evaluation, GRPO prompts and preference pairs read; an RL prompt without a
    reference (``data.response_key=null``) has none and no ``has_reference``. ``columns`` is the row as read
    (reward functions receive each column by its name), ``source`` where it is (``train.jsonl row 3``); neither
    takes part in comparing examples.
    """

    prompt_ids: list[int]
    response_ids: list[int]
    prompt_text: str
    response_text: str
    earlier_turn_spans: tuple[tuple[int, int], ...] = ()
    has_reference: bool = True
    columns: Mapping[str, Any] = field(default_factory=dict, compare=False)
    source: str = field(default="", compare=False)

    @property
    def token_ids(self) -> list[int]:
        """The whole sequence: prompt, then response."""
        return self.prompt_ids + self.response_ids

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


def read_rows(
    path: str | Path, *, split: str = "train", dataset_config: str | None = None
) -> list[dict[str, Any]]:
    """Rows of a ``.parquet`` or ``.jsonl``/``.json`` file, or of the ``split`` of a Hugging Face dataset (a folder
    or a Hub id, :mod:`.dataset_rows`; ``dataset_config`` names its config), as dicts.

    Raises:
        DataError: the file is missing, has another extension, is not readable as its format (corrupt
            parquet, JSONL that is not UTF-8), or a JSONL line is not a JSON object.
        DatasetSourceError: a dataset folder or Hub id that cannot be loaded.
    """
    if is_dataset_source(str(path)):
        return dataset_rows(str(path), split=split, dataset_config=dataset_config)
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file {path} does not exist; {SUPPORTED_SOURCES}.")
    if path.suffix == ".parquet":
        return _read_parquet(path)
    if path.suffix in (".jsonl", ".json"):
        return _read_jsonl(path)
    raise DataError(f"data file {path} has extension {path.suffix!r}; {SUPPORTED_SOURCES}.")


def read_options(config: Any, *, held_out: bool) -> dict[str, Any]:
    """The ``read_rows`` arguments a data section (``data``) gives its training or held-out sources."""
    return {
        "split": config.val_split if held_out else config.train_split,
        "dataset_config": config.dataset_config,
    }


def _read_parquet(path: Path) -> list[dict[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return list(pq.read_table(path).to_pylist())
    except (pa.ArrowException, OSError) as e:
        raise DataError(
            f"data file {path} is not a readable parquet file ({type(e).__name__}: {e}); re-export it, e.g. "
            "with pandas.DataFrame.to_parquet."
        ) from e


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            f"data file {path} is not UTF-8 (byte {e.start} is {e.object[e.start : e.start + 1]!r}); "
            "re-encode it as UTF-8, e.g. iconv -f latin1 -t utf-8."
        ) from e
    rows = []
    # NOTE: lines end at "\n" only: ``str.splitlines`` also splits at U+2028, U+2029 and U+0085, which JSON
    # allows raw inside strings (``json.dumps(..., ensure_ascii=False)`` writes them so).
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(
                f"{path}:{number} is not valid JSON ({e.msg}); write one JSON object per line."
            ) from e
        if not isinstance(row, dict):
            raise DataError(
                f"{path}:{number} is a JSON {type(row).__name__}, not an object; write one object per line, "
                'such as {"prompt": "...", "response": "..."}.'
            )
        rows.append(row)
    return rows


def load_examples(
    files: Sequence[str | Path], tokenizer: Any, config: DataConfig, *, held_out: bool = False
) -> list[Example]:
    """Read, tokenise and check every example of ``files`` (``held_out``: ``data.val_files``, read at
    ``data.val_split`` where a source has splits); with ``data.overlong=drop``, skip the over-long ones.

    Raises:
        DataError: no file or no rows, a missing column, or an example longer than ``config.max_length``
            (``data.overlong=error``).
    """
    if not files:
        raise DataError(f"no data files given; set data.train_files. {SUPPORTED_SOURCES}.")
    examples = []
    overlong = OverlongRows(config.max_length, config.overlong, prompt_only=config.response_key is None)
    for path in files:
        rows = read_rows(path, **read_options(config, held_out=held_out))
        for index, row in enumerate(rows):
            where = f"{path} row {index}"
            example = tokenize_row(row, tokenizer, config, where=where)
            if overlong.fits([example], where):
                examples.append(example)
    overlong.report(files, kept=len(examples), unit="examples")
    if not examples:
        raise DataError(f"the data set {[str(f) for f in files]} is empty; give files with at least one row.")
    return examples


def tokenize_row(row: dict[str, Any], tokenizer: Any, config: DataConfig, *, where: str) -> Example:
    """Tokenise one row: chat ``messages`` (loss on the assistant turns ``data.assistant_turns`` picks) or a
    prompt/response pair; with ``data.response_key=null`` a prompt alone (the prompt column, or the whole
    conversation). The example keeps the row's columns and ``where`` it is."""
    return dataclasses.replace(_tokenized(row, tokenizer, config, where), columns=row, source=where)


def _tokenized(row: dict[str, Any], tokenizer: Any, config: DataConfig, where: str) -> Example:
    if config.response_key is None:
        return _prompt_only(row, tokenizer, config, where)
    if config.messages_key is not None:
        messages = column(row, config.messages_key, where, "data.messages_key")
        return tokenize_messages(messages, tokenizer, where, earlier_turns=config.assistant_turns == "all")
    prompt = text_value(row, config.prompt_key, where, "data.prompt_key")
    response = text_value(row, config.response_key, where, "data.response_key")
    if config.apply_chat_template:
        conversation = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
        return tokenize_messages(conversation, tokenizer, where)
    return tokenize_prompt_response(
        prompt, response, tokenizer, where=where, columns=(config.prompt_key, config.response_key)
    )


def tokenize_prompt_response(
    prompt: str, response: str, tokenizer: Any, *, where: str, columns: tuple[str, str]
) -> Example:
    """The prompt as ``tokenizer(prompt)`` encodes it, special tokens included (no loss), then response + eos
    (loss); ``columns`` name the two texts in errors.

    NOTE: the prompt's special tokens are the tokenizer's own (a BOS for Llama, none for Qwen or GPT-2 style
    tokenizers), as TRL tokenizes a prompt and as a user's ``tokenizer(prompt)`` + ``generate`` sees it; a BOS
    was prepended whenever the tokenizer had one, even where it never adds it. A prompt already rendered with
    its BOS (a chat template's output) keeps one BOS, not two; a response already ending with the EOS keeps
    one EOS (TRL appends it only when missing).
    """
    eos = tokenizer.eos_token_id
    prompt_ids = prompt_token_ids(prompt, tokenizer, f"{where} column {columns[0]!r}")
    response_ids = _with_eos(_encode(tokenizer, response, f"{where} column {columns[1]!r}"), eos)
    return Example(
        prompt_ids=prompt_ids, response_ids=response_ids, prompt_text=prompt, response_text=response
    )


def prompt_token_ids(prompt: str, tokenizer: Any, where: str) -> list[int]:
    """``tokenizer(prompt)``'s ids, one BOS at most, and the BOS alone for an empty prompt (see
    :func:`tokenize_prompt_response`)."""
    bos = tokenizer.bos_token_id
    _encode(tokenizer, prompt, where)  # refuses unknown characters
    prompt_ids = list(tokenizer(prompt)["input_ids"])
    if bos is not None and prompt_ids[:2] == [bos, bos]:
        prompt_ids = prompt_ids[1:]
    if not prompt_ids and bos is not None:
        # An empty prompt (completion-only rows): the first response token needs a token before it to be scored.
        prompt_ids = [bos]
    return prompt_ids


def _with_eos(ids: list[int], eos: int | None) -> list[int]:
    """``ids`` ending with the EOS: appended unless already last (TRL's rule), so a response teaches to stop."""
    return ids if eos is None or ids[-1:] == [eos] else [*ids, eos]


def column(row: dict[str, Any], key: str, where: str, option: str) -> Any:
    """``row[key]``, or an error naming the row's columns and the config ``option`` that picks the column."""
    if key not in row:
        raise DataError(
            f"{where} has no column {key!r}; its columns are {sorted(row)}. Set {option}=<column> to the column "
            "that holds it (or data.messages_key=<column> for chat messages)."
        )
    return row[key]


def text_value(row: dict[str, Any], key: str, where: str, option: str) -> str:
    """A text value (prompt, response), which must be a string: ``None`` or a list would train on its repr."""
    value = column(row, key, where, option)
    if not isinstance(value, str):
        raise DataError(
            f"{where} column {key!r} holds {type(value).__name__} {str(value)[:40]!r}, not text; fix or drop the "
            f"row, or point {option} at the column that holds the text."
        )
    return value


def _encode(tokenizer: Any, text: str, where: str) -> list[int]:
    """Token ids of ``text``, refusing characters the tokenizer maps to its unknown (or padding) token or drops
    (:func:`.token_coverage.encode_with_unknown`)."""
    ids, characters = encode_with_unknown(tokenizer, text)
    if not characters:
        return ids
    raise DataError(
        f"{where} has characters the tokenizer does not know ({''.join(sorted(characters))!r}); it would train on "
        "unknown/padding tokens in their place, or without them. Remove them from the data or use a tokenizer "
        "(model.path) that covers them."
    )


def tokenize_messages(messages: Any, tokenizer: Any, where: str, *, earlier_turns: bool = False) -> Example:
    """Prompt = the chat template of every turn before the last (with the generation prompt); response = the rest,
    the template's turn end included, then the EOS.

    NOTE: a base model's tokenizer ends a turn with a token that is not its EOS (ChatML's ``<|im_end|>`` with
    ``</s>``): without the EOS the model never learnt to stop, and greedy answers ran to ``max_new_tokens``. TRL
    appends the EOS to text that does not end with it (its chat path leaves it to the template, and offers
    ``SFTConfig.eos_token`` for the turn end); every response here ends with both, the EOS not doubled where
    the template writes it (Mistral's ``</s>``), and the exported model stops at either
    (:mod:`~drivetrain_roles.jobs.stop_tokens`).

    With ``earlier_turns``, the earlier assistant turns inside the prompt are marked for loss too (verl's
    multi-turn SFT dataset, TRL's ``assistant_only_loss``): each turn's tokens are what rendering the conversation
    through that turn adds to rendering the turns before it with the generation prompt.
    """
    if not isinstance(messages, list) or not messages or messages[-1].get("role") != "assistant":
        raise DataError(
            f"{where}: messages must be a non-empty list of {{'role', 'content'}} dicts ending with an assistant "
            "turn (the response that is trained on)."
        )
    if getattr(tokenizer, "chat_template", None) is None:
        raise DataError(f"{where}: the tokenizer has no chat template; use prompt/response columns instead.")
    prompt_ids = template_ids(tokenizer, messages[:-1], add_generation_prompt=True)
    full_ids = template_ids(tokenizer, messages, add_generation_prompt=False)
    if full_ids[: len(prompt_ids)] != prompt_ids:
        raise DataError(
            f"{where}: the chat template does not render the conversation as prompt + response (the prompt's tokens "
            "are not a prefix of the full conversation's), so the response cannot be masked."
        )
    return Example(
        prompt_ids=prompt_ids,
        response_ids=_with_eos(full_ids[len(prompt_ids) :], tokenizer.eos_token_id),
        prompt_text=tokenizer.decode(prompt_ids),
        response_text=str(messages[-1].get("content", "")),
        earlier_turn_spans=_earlier_turn_spans(tokenizer, messages, prompt_ids, where)
        if earlier_turns
        else (),
    )


def _prompt_only(row: dict[str, Any], tokenizer: Any, config: DataConfig, where: str) -> Example:
    """A row without a reference (``data.response_key=null``, RL prompts): the prompt column as written, or
    rendered by the chat template with the generation prompt (``apply_chat_template``; every turn of
    ``messages_key``)."""
    if config.messages_key is None:
        prompt = text_value(row, config.prompt_key, where, "data.prompt_key")
        if not config.apply_chat_template:
            ids = prompt_token_ids(prompt, tokenizer, f"{where} column {config.prompt_key!r}")
            return Example(
                prompt_ids=ids, response_ids=[], prompt_text=prompt, response_text="", has_reference=False
            )
    key = config.messages_key
    messages = (
        [{"role": "user", "content": prompt}] if key is None else column(row, key, where, "data.messages_key")
    )
    if not isinstance(messages, list) or not messages or getattr(tokenizer, "chat_template", None) is None:
        raise DataError(
            f"{where}: the prompt must be a non-empty list of messages and the tokenizer needs a chat template."
        )
    ids = template_ids(tokenizer, messages, add_generation_prompt=True)
    return Example(
        prompt_ids=ids,
        response_ids=[],
        prompt_text=tokenizer.decode(ids),
        response_text="",
        has_reference=False,
    )


def _earlier_turn_spans(
    tokenizer: Any, messages: list[dict[str, Any]], prompt_ids: list[int], where: str
) -> tuple[tuple[int, int], ...]:
    """The ``[start, end)`` token ranges of ``prompt_ids`` holding the assistant turns before the last one.

    Raises:
        DataError: the template renders an earlier turn differently once later turns follow it (Qwen3's template
            drops the reasoning of earlier turns), so its tokens cannot be located in the conversation.
    """
    spans = []
    for index, message in enumerate(messages[:-1]):
        if message.get("role") != "assistant":
            continue
        before = template_ids(tokenizer, messages[:index], add_generation_prompt=True) if index else []
        through = template_ids(tokenizer, messages[: index + 1], add_generation_prompt=False)
        if through[: len(before)] != before or prompt_ids[: len(through)] != through:
            raise DataError(
                f"{where}: the chat template renders assistant turn {index} differently once later turns follow it "
                "(e.g. it drops their reasoning), so that turn cannot be trained on in place; set "
                "data.assistant_turns=last to train on the last assistant turn only, or split the conversation "
                "into one row per assistant turn."
            )
        spans.append((len(before), len(through)))
    return tuple(spans)


def template_ids(tokenizer: Any, messages: list[dict[str, Any]], *, add_generation_prompt: bool) -> list[int]:
    """The token ids of ``messages`` rendered by the tokenizer's chat template."""
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


class OverlongRows:
    """Applies ``data.overlong`` to the rows of one data set: refuses an example longer than ``max_length``
    (``error``) or counts it for one warning (``drop``)."""

    def __init__(self, max_length: int, policy: str, *, prompt_only: bool = False) -> None:
        self.max_length, self.policy, self.prompt_only = max_length, policy, prompt_only
        self.dropped, self.longest = 0, 0

    def fits(self, sequences: Sequence[Example], where: str) -> bool:
        """Whether the row of ``sequences`` (one example, or a pair's two sides) is kept.

        Raises:
            DataError: a sequence has an empty response (under every policy, unless the rows are prompts only),
                or is over-long under ``error``.
        """
        for example in sequences:
            if not example.response_ids and not self.prompt_only:
                raise DataError(
                    f"{where} has an empty response; every example needs response tokens to train on."
                )
        longest = max(sequences, key=lambda example: example.length)
        if longest.length <= self.max_length:
            return True
        if self.policy == "error":
            raise DataError(
                f"{where} has {longest.length} tokens (prompt {len(longest.prompt_ids)} + response "
                f"{len(longest.response_ids)}), more than the token budget data.max_length={self.max_length}. "
                "Raise data.max_length (and engine.micro_batch.max_tokens if set), set data.overlong=drop to "
                "skip such rows, or remove them."
            )
        self.dropped, self.longest = self.dropped + 1, max(self.longest, longest.length)
        return False

    def report(self, files: Sequence[str | Path], *, kept: int, unit: str) -> None:
        """Warn (rank 0) how many rows ``data.overlong=drop`` skipped, or, when it skipped every one, refuse."""
        if not self.dropped:
            return
        summary = (
            f"{self.dropped} of {self.dropped + kept} {unit} of {[str(f) for f in files]} are longer than "
            f"data.max_length={self.max_length} tokens (the longest has {self.longest})"
        )
        if not kept:
            raise DataError(f"{summary}: data.overlong=drop leaves none. Raise data.max_length.")
        if distributed.rank() == 0:
            logger.warning("%s; data.overlong=drop skips them.", summary)

"""Which characters of a text a tokenizer cannot encode: the ones it maps to its unknown (or padding) token, and
the ones it drops without a trace."""

from __future__ import annotations

from typing import Any


def encode_with_unknown(tokenizer: Any, text: str) -> tuple[list[int], set[str]]:
    """The token ids of ``text`` (no special tokens) and the characters the tokenizer does not know.

    NOTE: a BPE vocabulary without an unknown token drops what it cannot encode, with no trace in the ids:
    transformers 5 reloads the embedded model's character tokenizer as ``Qwen2Tokenizer`` (its model type's
    class), which encodes ``"Two?"`` as nothing. A fast tokenizer's offsets show characters no token covers;
    slow tokenizers report none, and only their unknown tokens are caught.
    """
    if getattr(tokenizer, "is_fast", False):
        encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, characters = encoding["input_ids"], _uncovered(text, encoding["offset_mapping"])
    else:
        ids, characters = tokenizer.encode(text, add_special_tokens=False), set()
    unknown = {tokenizer.unk_token_id, tokenizer.pad_token_id} - {
        None,
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
    }
    if not unknown.isdisjoint(ids):
        characters |= {c for c in set(text) if unknown & set(tokenizer.encode(c, add_special_tokens=False))}
    return list(ids), characters


def _uncovered(text: str, offsets: list[tuple[int, int]]) -> set[str]:
    """Characters of ``text`` that no token's offsets cover, besides whitespace (tokenizers fold it into tokens)."""
    covered = bytearray(len(text))
    for start, end in offsets:
        covered[start:end] = b"\x01" * (end - start)
    return {c for c, seen in zip(text, covered, strict=True) if not seen and not c.isspace()}

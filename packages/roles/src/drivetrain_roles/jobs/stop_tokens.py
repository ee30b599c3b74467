"""The tokens a trained model's answer ends with: the tokenizer's EOS and the chat template's turn end.

A base model's tokenizer often carries a chat template whose turn end is not its EOS (ChatML's ``<|im_end|>``
on a tokenizer whose EOS is ``</s>`` or ``<|endoftext|>``). Chat examples end with both
(:func:`~drivetrain_roles.jobs.data.tokenize_messages`); generation stops at either, as an instruct model's
``generation_config.json`` lists both (Qwen2.5-Instruct: ``<|im_end|>`` and ``<|endoftext|>``), so an answer
ends where its turn ends instead of running on to ``max_new_tokens``.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from .data import template_ids

PROBE = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hi"}]
"""A plain exchange, which every chat template renders: what its assistant turn adds is the turn end."""


def stop_token_ids(tokenizer: Any) -> list[int]:
    """The tokenizer's EOS, then the special tokens the chat template closes an assistant turn with.

    The turn end is counted as the special tokens that rendering :data:`PROBE` adds to rendering its user turn
    with the generation prompt (ChatML's ``<|im_end|>``, Llama 3's ``<|eot_id|>``, Gemma's ``<end_of_turn>``):
    counting needs no prefix agreement between the two renderings, and the content's own tokens are not
    special. BOS, padding and unknown tokens never stop an answer. Without a chat template: the EOS alone.
    """
    eos = tokenizer.eos_token_id
    stops = [] if eos is None else [eos]
    if getattr(tokenizer, "chat_template", None) is None:
        return stops
    ignored = {eos, tokenizer.bos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
    special = _special_ids(tokenizer) - ignored
    prompt = template_ids(tokenizer, PROBE[:1], add_generation_prompt=True)
    full = template_ids(tokenizer, PROBE, add_generation_prompt=False)
    added = Counter(t for t in full if t in special) - Counter(t for t in prompt if t in special)
    return stops + sorted(added)


def _special_ids(tokenizer: Any) -> set[int]:
    """The named special tokens and every added token marked special: a turn end need not be named among the
    tokenizer's special-token attributes (Llama 3's ``<|eot_id|>`` is an added special token)."""
    added = {index for index, token in tokenizer.added_tokens_decoder.items() if token.special}
    return added | set(tokenizer.all_special_ids)

"""A tiny character-level tokenizer built locally, so tests never need a model hub.

Every character of the alphabet is one token, a few whole words are extra tokens (matched before the
character split), and the chat-role markers are special tokens. The chat template is a plain ChatML-style
jinja loop so ``apply_chat_template`` works exactly as with a real chat model.

Characters are spelt byte-level, as GPT-2, Llama 3 and Qwen vocabularies are (space ``Ġ``, newline ``Ċ``),
with a byte-level pre-tokenizer and decoder, so a saved directory reads back the same whichever class
``AutoTokenizer`` picks: next to a ``qwen2`` config it loads ``Qwen2Tokenizer``, which keeps the vocabulary
but installs its own byte-level pipeline (a vocabulary holding a plain ``" "`` lost every space).
"""

from __future__ import annotations

import string
from collections.abc import Iterable

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
PAD_TOKEN = "<pad>"
UNK_TOKEN = "<unk>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN, IM_START, IM_END)
BYTE_LEVEL = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
"""Maps each byte to a printable character, as GPT-2, Llama 3 and Qwen tokenizers do."""
DEFAULT_WORDS = ("system", "user", "assistant", "hello", "world", "the", "answer", "is")

CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _characters() -> list[str]:
    """Digits, ASCII letters, punctuation, space and newline: enough for any test prompt."""
    return list(string.digits + string.ascii_letters + string.punctuation + " \n")


def _byte_level(character: str) -> str:
    """``character`` as the byte-level pre-tokenizer spells it (``" "`` is ``"Ġ"``, letters stay themselves)."""
    return str(BYTE_LEVEL.pre_tokenize_str(character)[0][0])


def build_tiny_tokenizer(vocab: Iterable[str] | None = None) -> PreTrainedTokenizerFast:
    """Build a small character-level fast tokenizer with bos/eos/pad tokens and a chat template.

    Args:
        vocab: Whole words to add as single tokens (matched before the character split). Defaults to a few
            words used by the test prompts (``hello``, ``world``, the chat roles, ...).

    Returns:
        A ``PreTrainedTokenizerFast`` of about 110 tokens; ``save_pretrained`` writes a normal tokenizer
        directory that ``AutoTokenizer.from_pretrained`` loads back.
    """
    words = [w for w in dict.fromkeys(DEFAULT_WORDS if vocab is None else vocab) if w]
    symbols = list(SPECIAL_TOKENS) + [_byte_level(c) for c in _characters()]
    token_to_id = {token: index for index, token in enumerate(symbols)}
    backend = Tokenizer(models.WordLevel(vocab=token_to_id, unk_token=UNK_TOKEN))
    # Each character is its own pre-token, spelled byte-level; WordLevel then maps it to its id.
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex("."), behavior="isolated"), BYTE_LEVEL]
    )
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        additional_special_tokens=[IM_START, IM_END],
    )
    tokenizer.add_tokens([w for w in words if w not in token_to_id])
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer

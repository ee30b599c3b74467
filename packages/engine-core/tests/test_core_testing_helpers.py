"""The conformance kit's own helpers: tiny tokenizer and models, random batches, test losses, and the Hugging
Face references, checked against a padded batched forward (a different code path) and by hand."""

from __future__ import annotations

import json
import string
from pathlib import Path

import pytest
import torch
from drivetrain_engine_core.backend import ForwardOptions, OptimizerConfig
from drivetrain_engine_core.job import LossContext
from drivetrain_engine_core.testing.batches import random_batch
from drivetrain_engine_core.testing.losses import token_mean_nll, value_mse
from drivetrain_engine_core.testing.models import ARCHITECTURES, lean_model_dir, make_tiny_model_dir
from drivetrain_engine_core.testing.reference import (
    reference_entropy,
    reference_log_probs,
    reference_loss_and_grad_norm,
    reference_train_losses,
    reference_values,
)
from drivetrain_engine_core.testing.tokenizer import IM_END, build_tiny_tokenizer
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer

PROMPTS, RESPONSES = [3, 1, 4], [2, 5, 3]


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("lm"), arch="llama")


@pytest.fixture(scope="module")
def value_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("value"), model_type="value_model")


def vocab_size(model_dir: Path) -> int:
    return json.loads((model_dir / "config.json").read_text())["vocab_size"]


def padded(batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids and attention mask of a no-padding batch, built by hand."""
    sequences = batch["input_ids"].unbind()
    width = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), width, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for row, seq in enumerate(sequences):
        ids[row, : len(seq)], mask[row, : len(seq)] = seq, 1
    return ids, mask


def test_tokenizer_round_trips_text_and_chat(tmp_path: Path) -> None:
    tokenizer = build_tiny_tokenizer()
    ids = tokenizer("hello 42!")["input_ids"]
    assert tokenizer.convert_ids_to_tokens(ids) == ["hello", "Ġ", "4", "2", "!"]
    assert tokenizer.decode(ids) == "hello 42!"
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nok<|im_end|>\n"
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert (loaded.pad_token, loaded.bos_token, loaded.eos_token) == ("<pad>", "<s>", "</s>")
    assert loaded("hello 42!")["input_ids"] == ids and len(loaded) == len(tokenizer)
    assert build_tiny_tokenizer(["zebra"]).convert_ids_to_tokens(
        build_tiny_tokenizer(["zebra"])("zebra")["input_ids"]
    ) == ["zebra"]


def test_every_tiny_model_dir_reloads_a_tokenizer_that_round_trips_printable_ascii(tmp_path: Path) -> None:
    """Next to a ``qwen2`` config ``AutoTokenizer`` loads ``Qwen2Tokenizer``, which keeps the vocabulary but
    swaps in its own byte-level pipeline: a vocabulary spelling space as ``" "`` lost every space and newline
    (18 of 165 characters here), and the letter after each one lost its offsets, so the roles' data check
    called it unknown. Ids are checked against the alphabet's order, written out in this test."""
    ascii_text = "".join(chr(code) for code in range(32, 127)) + "\n"
    alphabet = string.digits + string.ascii_letters + string.punctuation + " \n"
    text = f"The quick brown fox jumps over the lazy dog.\n  It's {ascii_text}the answer is 42\n"
    for arch in ARCHITECTURES:
        loaded = AutoTokenizer.from_pretrained(make_tiny_model_dir(tmp_path / arch, arch=arch))
        ids = loaded(text)["input_ids"]
        assert loaded.decode(ids) == text, arch
        encoding = loaded(ascii_text, return_offsets_mapping=True)
        assert encoding["input_ids"] == [6 + alphabet.index(c) for c in ascii_text], arch
        assert encoding["offset_mapping"] == [(i, i + 1) for i in range(len(ascii_text))], arch
        assert loaded("the cat")["input_ids"] == [107, 100, 18, 16, 35], arch  # the ids before the fix
        assert loaded.unk_token_id not in ids and ids == build_tiny_tokenizer()(text)["input_ids"], arch


def test_tiny_models_load_with_from_pretrained_and_seed_sets_weights(tmp_path: Path) -> None:
    first = make_tiny_model_dir(tmp_path / "a", arch="qwen2", seed=1)
    again = make_tiny_model_dir(tmp_path / "b", arch="qwen2", seed=1, with_tokenizer=False)
    other = make_tiny_model_dir(tmp_path / "c", arch="qwen2", seed=2, hidden_size=64)
    model = AutoModelForCausalLM.from_pretrained(first)
    config = model.config
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (32, 2, 4)
    assert config.vocab_size == len(AutoTokenizer.from_pretrained(first)) and not config.tie_word_embeddings
    same = AutoModelForCausalLM.from_pretrained(again).state_dict()
    assert all(torch.equal(v, same[k]) for k, v in model.state_dict().items())
    assert AutoModelForCausalLM.from_pretrained(other).config.hidden_size == 64
    assert not (again / "tokenizer.json").exists() and (first / "model.safetensors").exists()
    critic = AutoModelForTokenClassification.from_pretrained(
        make_tiny_model_dir(tmp_path / "v", model_type="value_model")
    )
    assert critic.config.num_labels == 1
    with pytest.raises(
        ValueError,
        match=r"arch='gpt2' is not supported; use one of \('qwen2', 'llama', 'qwen3_moe', 'qwen2_moe', 'mixtral'\)",
    ):
        make_tiny_model_dir(tmp_path / "x", arch="gpt2")


def test_random_batch_masks_prompts_and_is_seeded() -> None:
    batch = random_batch(
        vocab_size=50, prompt_lengths=PROMPTS, response_lengths=RESPONSES, seed=3, with_returns=True
    )
    assert batch["input_ids"].offsets().diff().tolist() == [5, 6, 7]
    assert [m.tolist() for m in batch["loss_mask"].unbind()] == [
        [False] * p + [True] * r for p, r in zip(PROMPTS, RESPONSES, strict=True)
    ]
    assert int(batch["input_ids"].values().max()) < 50 and "returns" in batch
    again = random_batch(vocab_size=50, prompt_lengths=PROMPTS, response_lengths=RESPONSES, seed=3)
    assert torch.equal(again["input_ids"].values(), batch["input_ids"].values())
    with pytest.raises(ValueError, match="3 prompt lengths but 2 response lengths"):
        random_batch(vocab_size=50, prompt_lengths=PROMPTS, response_lengths=[1, 2], seed=0)


def test_losses_by_hand() -> None:
    batch = random_batch(
        vocab_size=9, prompt_lengths=[1, 2], response_lengths=[2, 1], seed=0, with_returns=True
    )
    offsets = batch["input_ids"].offsets()
    log_probs = torch.nested.nested_tensor_from_jagged(
        torch.tensor([0.0, -1.0, -2.0, 0.0, -5.0, -3.0]), offsets
    )
    context = LossContext(global_token_count=6, global_sequence_count=2)
    loss, metrics = token_mean_nll({"log_probs": log_probs}, batch, context)
    assert float(loss) == pytest.approx((1 + 2 + 3) / 6) and metrics == {"nll_sum": 6.0}
    values = torch.nested.nested_tensor_from_jagged(batch["returns"].values() + 2.0, offsets)
    loss, _ = value_mse({"values": values}, batch, context)
    assert float(loss) == pytest.approx(0.5 * 4 * 3 / 6)


def test_reference_log_probs_and_entropy_match_a_padded_batched_forward(lm_dir: Path) -> None:
    batch = random_batch(
        vocab_size=vocab_size(lm_dir), prompt_lengths=PROMPTS, response_lengths=RESPONSES, seed=0
    )
    ids, mask = padded(batch)
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(lm_dir)(input_ids=ids, attention_mask=mask).logits / 0.5
    logp = torch.log_softmax(logits, -1)
    for row, (lp, ent) in enumerate(
        zip(
            reference_log_probs(lm_dir, batch, 0.5).unbind(),
            reference_entropy(lm_dir, batch, 0.5).unbind(),
            strict=True,
        )
    ):
        n = len(lp)
        expected = logp[row, : n - 1].gather(-1, ids[row, 1:n, None]).squeeze(-1)
        assert lp[0] == 0 and ent[0] == 0
        torch.testing.assert_close(lp[1:], expected, atol=1e-5, rtol=0)
        torch.testing.assert_close(
            ent[1:], -(logp[row, : n - 1].exp() * logp[row, : n - 1]).sum(-1), atol=1e-5, rtol=0
        )


def test_reference_values_read_the_previous_hidden_state(value_dir: Path) -> None:
    batch = random_batch(
        vocab_size=vocab_size(value_dir), prompt_lengths=PROMPTS, response_lengths=RESPONSES, seed=1
    )
    ids, mask = padded(batch)
    with torch.no_grad():
        scores = AutoModelForTokenClassification.from_pretrained(value_dir)(
            input_ids=ids, attention_mask=mask
        ).logits
    for row, values in enumerate(reference_values(value_dir, batch).unbind()):
        assert values[0] == 0
        torch.testing.assert_close(values[1:], scores[row, : len(values) - 1, 0], atol=1e-5, rtol=0)


def test_reference_loss_grad_norm_and_training_curve(lm_dir: Path) -> None:
    batch = random_batch(
        vocab_size=vocab_size(lm_dir), prompt_lengths=PROMPTS, response_lengths=RESPONSES, seed=2
    )
    ids, mask = padded(batch)
    model = AutoModelForCausalLM.from_pretrained(lm_dir)
    logp = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits, -1)
    nll = torch.stack(
        [
            -logp[row, :-1].gather(-1, ids[row, 1:, None]).squeeze(-1)[m[1:]].sum()
            for row, m in enumerate(_masks(batch, ids))
        ]
    ).sum() / sum(RESPONSES)
    nll.backward()
    norm = torch.sqrt(sum(p.grad.double().square().sum() for p in model.parameters()))
    loss, grad_norm = reference_loss_and_grad_norm(lm_dir, batch, token_mean_nll)
    assert loss == pytest.approx(float(nll.detach()), rel=1e-5) and grad_norm == pytest.approx(
        float(norm), rel=1e-5
    )
    frozen = reference_train_losses(lm_dir, [batch] * 3, OptimizerConfig(lr=0.0), token_mean_nll)
    assert frozen == [(loss, grad_norm)] * 3
    moving = reference_train_losses(
        lm_dir, [batch] * 3, OptimizerConfig(lr=1e-2, warmup_steps=1), token_mean_nll
    )
    assert moving[0] == (loss, grad_norm) and moving[2][0] < moving[1][0] < loss
    tempered = ForwardOptions(temperature=2.0)
    assert reference_loss_and_grad_norm(lm_dir, batch, token_mean_nll, options=tempered)[0] != pytest.approx(
        loss
    )


def _masks(batch, ids: torch.Tensor) -> list[torch.Tensor]:
    """Each sequence's loss mask right-padded to the batch width (padding is never trained on)."""
    rows = torch.zeros(ids.shape, dtype=torch.bool)
    for row, m in enumerate(batch["loss_mask"].unbind()):
        rows[row, : len(m)] = m
    return list(rows)


def test_a_leaning_model_ranks_its_tokens_first_at_every_position_whatever_the_context(
    tmp_path: Path,
) -> None:
    """Two chat prompts of 60-100 tokens and random ids: at every position the three leaned-to tokens are the
    top three logits, in the order of their weights (``i``, ``s`` tied at 0.9, then the turn end at 0.75)."""
    tokenizer = build_tiny_tokenizer()
    leans = {"i": 0.9, "s": 0.9, IM_END: 0.75}
    path = lean_model_dir(make_tiny_model_dir(tmp_path / "m"), tokenizer, leans)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    chats = [
        [{"role": "user", "content": text}]
        for text in ("Say this: mist, kiss. " * 3, "What is 12*34+5? " * 4)
    ]
    texts = [
        tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) for chat in chats
    ]
    contexts = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    contexts.append(torch.randint(len(tokenizer), (80,), generator=torch.Generator().manual_seed(0)).tolist())
    ids = [tokenizer.convert_tokens_to_ids(t) for t in leans]
    for context in contexts:
        assert len(context) >= 60
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([context])).logits[0]
        assert (logits.topk(3).indices.sort().values == torch.tensor(sorted(ids))).all()
        assert (logits[:, ids[:2]].min(-1).values > logits[:, ids[2]]).all()
    with pytest.raises(ValueError, match=r"\['<nope>'\] are not tokens of the tokenizer"):
        lean_model_dir(path, tokenizer, {"<nope>": 1.0})

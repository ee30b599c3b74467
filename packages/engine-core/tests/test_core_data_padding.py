"""Padded <-> no-padding conversions round-trip exactly; response views match hand slicing."""

from __future__ import annotations

import pytest
import torch
from drivetrain_engine_core._data import padded_to_response, response_to_padded, response_view
from drivetrain_engine_core.backend import BatchError
from drivetrain_engine_core.job import make_batch, nopad_to_padded, padded_to_nopad
from hypothesis import given, settings
from hypothesis import strategies as st

PAD = 7

shapes = st.lists(st.tuples(st.integers(1, 6), st.integers(0, 6)), min_size=1, max_size=5)


def _sequences(prompt_response: list[tuple[int, int]], seed: int):
    gen = torch.Generator().manual_seed(seed)
    ids = [torch.randint(10, 100, (p + r,), generator=gen) for p, r in prompt_response]
    logp = [torch.randn(p + r, generator=gen) for p, r in prompt_response]
    mask = [
        torch.cat([torch.zeros(p), torch.randint(0, 2, (r,), generator=gen)]).bool()
        for p, r in prompt_response
    ]
    rope = [torch.randint(0, 50, (p + r, 3), generator=gen) for p, r in prompt_response]
    return ids, logp, mask, rope


@settings(max_examples=30, deadline=None)
@given(
    shapes=shapes, extra_prompt=st.integers(0, 2), extra_response=st.integers(0, 2), seed=st.integers(0, 99)
)
def test_nopad_padded_nopad_round_trip(shapes, extra_prompt, extra_response, seed):
    ids, logp, mask, rope = _sequences(shapes, seed)
    batch = make_batch(ids, position_ids=rope, loss_mask=mask, old_log_probs=logp)
    prompts = torch.tensor([p for p, _ in shapes])
    max_p = max(p for p, _ in shapes) + extra_prompt
    max_r = max(r for _, r in shapes) + extra_response
    padded = nopad_to_padded(
        batch, prompt_lengths=prompts, max_prompt_len=max_p, max_response_len=max_r, pad_token_id=PAD
    )
    assert padded["input_ids"].shape == (len(shapes), max_p + max_r)
    for b, (p, r) in enumerate(shapes):  # hand check of the layout
        row = padded["input_ids"][b]
        assert torch.equal(row[max_p - p : max_p + r], ids[b])
        assert bool((row[: max_p - p] == PAD).all()) and bool((row[max_p + r :] == PAD).all())
        assert padded["attention_mask"][b].tolist() == [0] * (max_p - p) + [1] * (p + r) + [0] * (max_r - r)
    back = padded_to_nopad(
        padded["input_ids"],
        padded["attention_mask"],
        position_ids=padded["position_ids"],
        response_mask=padded["response_mask"],
        old_log_probs=padded["old_log_probs"],
    )
    for key in ("input_ids", "position_ids", "loss_mask", "old_log_probs"):
        assert torch.equal(back[key].offsets(), batch[key].offsets())
        assert torch.equal(back[key].values(), batch[key].values()), key


@settings(max_examples=30, deadline=None)
@given(shapes=shapes, seed=st.integers(0, 99))
def test_padded_nopad_padded_round_trip(shapes, seed):
    gen = torch.Generator().manual_seed(seed)
    n, max_p, max_r = len(shapes), max(p for p, _ in shapes), max(r for _, r in shapes)
    attention = torch.zeros(n, max_p + max_r, dtype=torch.int64)
    response = torch.zeros_like(attention)
    for b, (p, r) in enumerate(shapes):
        attention[b, max_p - p : max_p + r] = 1
        response[b, max_p : max_p + r] = torch.randint(0, 2, (r,), generator=gen)
    ids = torch.where(attention.bool(), torch.randint(10, 100, attention.shape, generator=gen), PAD)
    positions = torch.where(attention.bool(), torch.cumsum(attention, 1) - 1, 0)
    values = torch.randn(n, max_p + max_r, generator=gen) * attention
    batch = padded_to_nopad(ids, attention, response_mask=response, values=values)
    assert torch.equal(batch["position_ids"].values(), positions[attention.bool()])
    back = nopad_to_padded(batch, prompt_lengths=torch.tensor([p for p, _ in shapes]), pad_token_id=PAD)
    expected = {
        "input_ids": ids,
        "attention_mask": attention,
        "position_ids": positions,
        "response_mask": response,
        "values": values,
    }
    assert set(back) == set(expected)
    for key, value in expected.items():
        assert back[key].dtype == value.dtype, key
        assert torch.equal(back[key], value), key


def test_padded_to_nopad_defaults_loss_mask_to_real_tokens():
    ids = torch.tensor([[0, 5, 6, 7, 0], [8, 9, 1, 2, 3]])
    attention = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    batch = padded_to_nopad(ids, attention)
    assert batch["input_ids"].values().tolist() == [5, 6, 7, 8, 9, 1, 2, 3]
    assert batch["position_ids"].values().tolist() == [0, 1, 2, 0, 1, 2, 3, 4]
    assert batch["loss_mask"].values().all()


def test_padded_to_nopad_refuses_a_nan_response_mask():
    ids = torch.tensor([[5, 6, 7], [8, 9, PAD]])
    response = torch.tensor([[0.0, 1.0, 1.0], [0.0, float("nan"), 0.0]])
    with pytest.raises(BatchError, match=r"padded_to_nopad: response_mask of sequence 1 holds 1 non-finite"):
        padded_to_nopad(ids, torch.tensor([[1, 1, 1], [1, 1, 0]]), response_mask=response)


def test_padding_errors_name_the_problem():
    ids = torch.zeros(2, 4, dtype=torch.int64)
    with pytest.raises(BatchError, match=r"attention_mask has shape \(2, 3\)"):
        padded_to_nopad(ids, torch.ones(2, 3))
    batch = make_batch([torch.arange(4), torch.arange(2)])
    with pytest.raises(BatchError, match=r"prompt has 3 tokens but max_prompt_len=2"):
        nopad_to_padded(batch, prompt_lengths=torch.tensor([3, 1]), max_prompt_len=2)
    with pytest.raises(BatchError, match=r"sequence 1 has a negative response length -1"):
        nopad_to_padded(batch, prompt_lengths=torch.tensor([1, 3]))


@settings(max_examples=30, deadline=None)
@given(shapes=shapes, seed=st.integers(0, 99))
def test_response_view_is_the_last_response_positions(shapes, seed):
    ids, logp, _, _ = _sequences(shapes, seed)
    batch = make_batch(ids, old_log_probs=logp)
    responses = torch.tensor([r for _, r in shapes])
    view = response_view(batch["old_log_probs"], responses)
    expected = [lp[len(lp) - r :] for lp, (_, r) in zip(logp, shapes, strict=True)]
    assert view._ragged_idx == 1
    assert torch.equal(view.values(), torch.cat(expected))
    width = max(r for _, r in shapes) + 1
    dense, mask = response_to_padded(batch["old_log_probs"], responses, width, pad_value=-5.0)
    for b, exp in enumerate(expected):
        assert torch.equal(dense[b, : len(exp)], exp)
        assert bool((dense[b, len(exp) :] == -5.0).all())
        assert mask[b].tolist() == [True] * len(exp) + [False] * (width - len(exp))


def test_response_errors_name_the_problem():
    batch = make_batch([torch.arange(4), torch.arange(2)])
    with pytest.raises(BatchError, match=r"response_lengths\[1\] = 3 but sequence 1 has 2 tokens"):
        response_view(batch["position_ids"], torch.tensor([1, 3]))
    with pytest.raises(BatchError, match=r"max_response_len=1"):
        response_to_padded(batch["position_ids"], torch.tensor([2, 1]), 1)


@settings(max_examples=30, deadline=None)
@given(shapes=shapes, seed=st.integers(0, 99), extra=st.sampled_from([(), (3,)]))
def test_response_width_fields_round_trip_to_jagged(shapes, seed, extra):
    """verl's ``response_to_nested``: row b of a (B, R, ...) tensor cut to its response length, per token."""
    gen = torch.Generator().manual_seed(seed)
    responses = torch.tensor([r for _, r in shapes])
    width = int(responses.max()) + 2
    dense = torch.randn(len(shapes), width, *extra, generator=gen)
    nested = padded_to_response(dense, responses)
    assert nested._ragged_idx == 1 and nested.offsets().diff().tolist() == responses.tolist()
    expected = [dense[b, : int(r)] for b, r in enumerate(responses)]  # the definition, row by row
    assert torch.equal(nested.values(), torch.cat(expected))
    # The round trip: response-width padded values back to the response view of per-token values.
    ids, logp, _, _ = _sequences(shapes, seed)
    per_token = make_batch(ids, old_log_probs=logp)["old_log_probs"]
    padded, _ = response_to_padded(per_token, responses, width)
    assert torch.equal(
        padded_to_response(padded, responses).values(), response_view(per_token, responses).values()
    )


def test_padded_to_response_errors_name_the_problem():
    with pytest.raises(BatchError, match=r"response_lengths\[1\] = 4 is outside \[0, 3\]"):
        padded_to_response(torch.zeros(2, 3), torch.tensor([1, 4]))
    with pytest.raises(BatchError, match=r"dense \(n, R, \.\.\.\) tensor with one row per response length"):
        padded_to_response(torch.zeros(3, 3), torch.tensor([1, 2]))

"""make_batch / validate_batch / sequence_lengths / global_token_count against hand-built expectations."""

from __future__ import annotations

import pytest
import torch
from drivetrain_engine_core._data import (
    LOSS_MASK_DTYPE,
    expand_to_tokens,
    global_token_count,
    sequence_lengths,
)
from drivetrain_engine_core.backend import BatchError
from drivetrain_engine_core.job import jagged, make_batch, validate_batch
from tensordict import TensorDict

LENGTHS = (3, 5, 2)


def _ids() -> list[torch.Tensor]:
    return [torch.arange(n) + 10 * i for i, n in enumerate(LENGTHS)]


def test_make_batch_defaults_and_fields():
    values3 = [torch.randn(n, 3) for n in LENGTHS]
    batch = make_batch(_ids(), values=values3, reward=torch.tensor([1.0, 2.0, 3.0]))
    assert batch.batch_size == torch.Size([3])
    assert sequence_lengths(batch).tolist() == list(LENGTHS)
    assert batch["position_ids"].values().tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0, 1]
    assert batch["loss_mask"].dtype == LOSS_MASK_DTYPE and bool(batch["loss_mask"].values().all())
    assert batch["values"].shape[2] == 3 and batch["values"]._ragged_idx == 1
    assert torch.equal(batch["values"].values(), torch.cat(values3))
    assert batch["reward"].tolist() == [1.0, 2.0, 3.0]
    # Every per-token field shares input_ids' offsets object, so jagged arithmetic between them works.
    assert batch["values"].offsets() is batch["input_ids"].offsets()
    assert (batch["values"][..., 0] * batch["loss_mask"]).shape[0] == 3


def test_loss_mask_is_bool_and_token_count_counts_it():
    mask = [torch.tensor([0, 1, 1]), torch.tensor([0, 0, 1, 1, 1]), torch.tensor([1.0, 0.0])]
    batch = make_batch(_ids(), loss_mask=mask)
    assert batch["loss_mask"].dtype == torch.bool
    assert global_token_count(batch) == 2 + 3 + 1


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_loss_mask_is_refused_not_made_true(bad):
    """``bool(nan)`` is true: a NaN mask silently trained on every token it should have masked out."""
    mask = [torch.tensor([0.0, 1.0, 1.0]), torch.tensor([0.0, 0.0, bad, 1.0, 1.0]), torch.tensor([1.0, 0.0])]
    with pytest.raises(BatchError, match=r"make_batch: loss_mask of sequence 1 holds 1 non-finite value"):
        make_batch(_ids(), loss_mask=mask)


def test_expand_to_tokens_repeats_each_sequences_value_over_its_tokens():
    """verl's ``expand_as_nested`` (its unit test's case): [1, 2, 3] over lengths 2, 3, 4."""
    like = jagged(torch.zeros(9, dtype=torch.int64), torch.tensor([0, 2, 5, 9]))
    out = expand_to_tokens(torch.tensor([1, 2, 3]), like)
    assert out.values().tolist() == [1, 1, 2, 2, 2, 3, 3, 3, 3]
    assert out.offsets() is like.offsets()
    # A per-sequence temperature per token combines with the batch's per-token fields (shared offsets).
    batch = make_batch(_ids())
    temperature = torch.tensor([0.5, 2.0, 1.0])
    scaled = batch["position_ids"] / expand_to_tokens(temperature, batch["input_ids"])
    expected = torch.cat([torch.arange(n) / t for n, t in zip(LENGTHS, temperature.tolist(), strict=True)])
    assert torch.equal(scaled.values(), expected)
    wide = expand_to_tokens(torch.arange(6.0).view(3, 2), batch["input_ids"])
    assert wide.shape[2] == 2 and wide.values()[-1].tolist() == [4.0, 5.0]


def test_expand_to_tokens_errors_name_the_problem():
    batch = make_batch(_ids())
    with pytest.raises(BatchError, match=r"one row per sequence \(3\)"):
        expand_to_tokens(torch.tensor([1, 2, 3, 4]), batch["input_ids"])
    with pytest.raises(BatchError, match=r"like must be a jagged \(n, j\) tensor"):
        expand_to_tokens(torch.tensor([1, 2, 3]), torch.zeros(3, 4))
    with pytest.raises(BatchError, match=r"like must be a jagged \(n, j\) tensor"):
        expand_to_tokens(torch.tensor([1, 2, 3]), batch["input_ids"].unsqueeze(-1))


def test_make_batch_rejects_length_mismatch_and_bad_dense():
    with pytest.raises(BatchError, match=r"'old_log_probs'.*\[3, 5, 2\]"):
        make_batch(_ids(), old_log_probs=[torch.zeros(3), torch.zeros(4), torch.zeros(2)])
    with pytest.raises(BatchError, match=r"dense field 'reward'.*first dim 3"):
        make_batch(_ids(), reward=torch.zeros(4))


def _batch_with(**overrides) -> TensorDict:
    batch = make_batch(_ids(), old_log_probs=[torch.zeros(n) for n in LENGTHS])
    for key, value in overrides.items():
        batch.set(key, value)
    return batch


def test_validate_accepts_good_batch():
    validate_batch(_batch_with(), required=("input_ids", "position_ids", "loss_mask", "old_log_probs"))


def test_validate_rejects_non_tensordict_and_empty():
    with pytest.raises(BatchError, match=r"TensorDict.*dict"):
        validate_batch({"input_ids": torch.zeros(3)})
    with pytest.raises(BatchError, match=r"at least one sequence"):
        validate_batch(TensorDict({}, batch_size=[0]))


def test_validate_names_missing_field():
    batch = _batch_with().exclude("position_ids")
    with pytest.raises(BatchError, match=r"missing field 'position_ids'"):
        validate_batch(batch)
    with pytest.raises(BatchError, match=r"missing field 'advantages'"):
        validate_batch(_batch_with(), required=("advantages",))


def test_validate_names_dense_per_token_field():
    batch = _batch_with().exclude("old_log_probs")
    batch.set("old_log_probs", torch.zeros(3, 4))
    with pytest.raises(BatchError, match=r"per-token field 'old_log_probs' must be a jagged"):
        validate_batch(batch)


def test_validate_names_strided_nested_input_ids():
    strided = torch.nested.nested_tensor([torch.arange(n) for n in LENGTHS])
    batch = TensorDict({"input_ids": strided}, batch_size=[3])
    with pytest.raises(BatchError, match=r"'input_ids'.*nested strided"):
        validate_batch(batch, required=())


def test_validate_names_wrong_ragged_dim():
    # (n, 2, j): ragged dim 2 — the layout verl's bugs come from.
    wrong = torch.nested.nested_tensor([torch.zeros(2, n) for n in LENGTHS], layout=torch.jagged)
    assert wrong._ragged_idx == 2
    batch = _batch_with()
    batch.set("advantages", wrong)
    with pytest.raises(BatchError, match=r"'advantages' has its ragged dim at 2"):
        validate_batch(batch)


def test_validate_names_offsets_mismatch():
    other = jagged(torch.zeros(10), torch.tensor([0, 4, 8, 10]))
    batch = _batch_with()
    batch.set("advantages", other)
    with pytest.raises(BatchError, match=r"'advantages' has sequence lengths \[4, 4, 2\].*\[3, 5, 2\]"):
        validate_batch(batch)


@pytest.mark.parametrize(
    ("key", "dtype", "message"),
    [
        ("input_ids", torch.float32, "'input_ids' must be a jagged|'input_ids' must have an integer"),
        ("position_ids", torch.float32, "'position_ids' must have an integer dtype"),
        ("position_ids", torch.bool, "'position_ids' must have an integer dtype"),
        ("old_log_probs", torch.int64, "'old_log_probs' must have a floating dtype"),
        ("loss_mask", torch.complex64, "'loss_mask' must be bool, integer or float"),
    ],
)
def test_validate_names_wrong_dtype(key, dtype, message):
    batch = _batch_with()
    value = batch[key]
    batch.set(key, jagged(value.values().to(dtype), value.offsets()))
    with pytest.raises(BatchError, match=message):
        validate_batch(batch)


def test_validate_accepts_int_and_float_loss_mask():
    for dtype in (torch.int64, torch.float32):
        batch = _batch_with()
        batch.set("loss_mask", jagged(batch["loss_mask"].values().to(dtype), batch["input_ids"].offsets()))
        validate_batch(batch)
        assert global_token_count(batch) == sum(LENGTHS)

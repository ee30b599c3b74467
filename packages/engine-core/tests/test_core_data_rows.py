"""move_batch keeps one shared offsets tensor; row selection and the split/restore fast paths match a hand
computation from the per-sequence lists the batch was built from."""

from __future__ import annotations

import pytest
import torch
from drivetrain_engine_core._data import move_batch, select_rows, split_micro_batches
from drivetrain_engine_core._data.batch import token_keys
from drivetrain_engine_core.backend import BatchError
from drivetrain_engine_core.job import MicroBatchConfig, jagged, make_batch, unshard_data, validate_batch
from tensordict import TensorDict

LENGTHS = (5, 3, 7, 2, 4, 6)


def _lists(seed: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, 100, (n,), generator=gen) for n in LENGTHS]
    return ids, [torch.randn(n, generator=gen) for n in LENGTHS]


def _batch() -> TensorDict:
    ids, adv = _lists()
    return make_batch(ids, advantages=adv, uid=torch.arange(len(LENGTHS)))


def _shares_offsets(batch: TensorDict) -> bool:
    offsets = batch["input_ids"].offsets()
    return all(batch.get(k).offsets() is offsets for k in token_keys(batch))


def _unshared_batch() -> TensorDict:
    """Equal but distinct offsets per field, as a caller assembling a TensorDict by hand gets."""
    ids, adv = _lists()
    offsets = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    return TensorDict(
        input_ids=jagged(torch.cat(ids), offsets.clone()),
        position_ids=jagged(torch.cat([torch.arange(n) for n in LENGTHS]), offsets.clone()),
        advantages=jagged(torch.cat(adv), offsets.clone()),
        batch_size=[len(LENGTHS)],
    )


def test_move_batch_to_another_device_shares_one_offsets_tensor():
    batch = _batch()
    naive = batch.to("meta")  # what micro_batch.to(device) does: one offsets copy per field
    assert naive["input_ids"].offsets() is not naive["advantages"].offsets()
    moved = move_batch(batch, "meta")
    assert moved["input_ids"].device.type == "meta" and moved["uid"].device.type == "meta"
    assert moved["input_ids"].offsets().device.type == "meta"
    assert _shares_offsets(moved)
    assert moved.batch_size == batch.batch_size and sorted(moved.keys()) == sorted(batch.keys())


def test_move_batch_rebuilds_unshared_fields_so_they_combine():
    batch = _unshared_batch()
    with pytest.raises(RuntimeError, match=r"binary pointwise function mul"):
        batch["advantages"] * batch["position_ids"]  # torch refuses unshared offsets
    moved = move_batch(batch, "cpu")
    assert _shares_offsets(moved)
    product = moved["advantages"] * moved["position_ids"]
    assert torch.equal(product.values(), batch["advantages"].values() * batch["position_ids"].values())


def test_move_batch_on_same_device_returns_the_batch():
    batch = _batch()
    assert move_batch(batch, "cpu") is batch
    assert move_batch(batch, torch.device("cpu")) is batch


@pytest.mark.parametrize("rows", [[4, 0, 2], [1, 2, 3], [5], [3, 4, 5, 0, 1, 2]])
def test_select_rows_matches_the_lists(rows):
    ids, adv = _lists()
    selected = select_rows(_batch(), torch.tensor(rows))
    assert _shares_offsets(selected)
    assert torch.equal(selected["input_ids"].values(), torch.cat([ids[i] for i in rows]))
    assert torch.equal(selected["advantages"].values(), torch.cat([adv[i] for i in rows]))
    assert selected["uid"].tolist() == rows
    assert selected["input_ids"].offsets().diff().tolist() == [LENGTHS[i] for i in rows]


def test_one_micro_batch_is_the_batch_and_restore_returns_outputs_untouched():
    batch = _batch()
    mbs = split_micro_batches(batch, MicroBatchConfig(micro_batch_size=len(LENGTHS)))
    assert mbs.batches == [batch] and mbs.batches[0] is batch
    out = TensorDict(
        log_probs=jagged(batch["advantages"].values() * 2, batch["input_ids"].offsets()), batch_size=[6]
    )
    restored = mbs.restore([out])
    assert restored["log_probs"] is out["log_probs"]
    assert (restored["log_probs"] * batch["loss_mask"]).shape[0] == len(LENGTHS)


def test_fixed_chunks_are_views_on_one_offsets_tensor():
    batch = _batch()
    mbs = split_micro_batches(batch, MicroBatchConfig(micro_batch_size=4))
    first, second = mbs.batches
    assert all(_shares_offsets(mb) for mb in mbs.batches)
    assert first["input_ids"].values().data_ptr() == batch["input_ids"].values().data_ptr()
    assert second["advantages"].offsets().tolist() == [0, 4, 10]
    assert torch.equal(second["advantages"].values(), batch["advantages"].values()[17:])


def test_restore_rejects_outputs_with_other_lengths_or_missing_fields():
    batch = _batch()
    mbs = split_micro_batches(batch, MicroBatchConfig(micro_batch_size=None, max_tokens=12))
    good = [TensorDict(lp=mb["advantages"], batch_size=mb.batch_size) for mb in mbs.batches]
    renamed = TensorDict(other=good[1]["lp"], batch_size=good[1].batch_size)
    with pytest.raises(BatchError, match=r"output 1 has no field 'lp'"):
        mbs.restore([good[0], renamed, *good[2:]])
    lengths = good[0]["lp"].offsets().diff()
    longer = lengths + torch.nn.functional.one_hot(torch.tensor(0), len(lengths))
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), longer.cumsum(0)])
    bad = TensorDict(lp=jagged(torch.zeros(int(offsets[-1])), offsets), batch_size=good[0].batch_size)
    with pytest.raises(BatchError, match=r"per-token output 'lp' has sequence lengths"):
        mbs.restore([bad, *good[1:]])


def test_unshard_rebuilds_fields_on_one_new_offsets_tensor():
    batch = _batch()
    indices = [torch.tensor([5, 1, 3]), torch.tensor([0, 4, 2])]
    merged = unshard_data([select_rows(batch, i) for i in indices], indices)
    assert _shares_offsets(merged)
    for key in ("input_ids", "advantages"):
        assert torch.equal(merged[key].values(), batch[key].values())
    assert merged["uid"].tolist() == list(range(len(LENGTHS)))


def test_validate_rejects_jagged_fields_with_holes():
    batch = _batch()
    offsets = batch["input_ids"].offsets()
    holes = torch.nested.nested_tensor_from_jagged(
        batch["advantages"].values(), offsets, lengths=offsets.diff().clamp(max=2)
    )
    batch.set("advantages", holes)
    with pytest.raises(BatchError, match=r"'advantages' is a jagged tensor with holes"):
        validate_batch(batch)

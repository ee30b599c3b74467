"""Core's merger building blocks: DCP single-tensor / single-layer reads and PEFT name classification."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from drivetrain_engine_core.backend import CheckpointError
from drivetrain_engine_core.kit import DCPTensorReader, split_peft_name


@pytest.fixture
def dcp_dir(tmp_path):
    generator = torch.Generator().manual_seed(0)
    state = {
        "stacked": torch.randn(3, 4, 5, generator=generator),
        "bias": torch.randn(7, generator=generator),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=str(tmp_path / "model"))
    return tmp_path / "model", state


def test_reads_full_tensors_and_single_layers(dcp_dir):
    directory, state = dcp_dir
    reader = DCPTensorReader(directory)
    assert {name: tuple(meta.size) for name, meta in reader.tensors.items()} == {
        "stacked": (3, 4, 5),
        "bias": (7,),
    }
    assert torch.equal(reader.read("bias"), state["bias"])
    assert torch.equal(reader.read("stacked"), state["stacked"])
    for layer in range(3):
        assert torch.equal(reader.read("stacked", index=layer), state["stacked"][layer])


def test_unknown_key_and_damaged_metadata_are_checkpoint_errors(dcp_dir):
    directory, _ = dcp_dir
    with pytest.raises(CheckpointError, match="has no tensor 'missing'"):
        DCPTensorReader(directory).read("missing")
    (directory / ".metadata").write_bytes(b"not a pickle")
    with pytest.raises(CheckpointError, match=r"cannot read the DCP metadata .*\.metadata"):
        DCPTensorReader(directory).read("bias")


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        (
            "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight",
            ("base", "model.layers.0.self_attn.q_proj.weight"),
        ),
        ("base_model.model.model.norm.weight", ("base", "model.norm.weight")),
        (
            "base_model.model.model.layers.1.self_attn.v_proj.lora_B.default.weight",
            ("adapter", "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"),
        ),
        ("base_model.model.score.modules_to_save.default.weight", ("saved", "score.weight")),
        ("base_model.model.score.original_module.weight", ("original", "score.weight")),
    ],
)
def test_split_peft_name(name, expected):
    assert split_peft_name(name) == expected

"""The streaming safetensors writer: shard boundaries, index, names, sizes."""

from __future__ import annotations

import json

import pytest
import torch
from drivetrain_ckpt_tools.writer import ShardedSafetensorsWriter, parse_size
from safetensors.torch import load_file


def _tensors():
    generator = torch.Generator().manual_seed(0)
    return {f"w{i}": torch.randn(10, 10, generator=generator) for i in range(5)}  # 400 bytes each


def test_single_shard_has_no_index(tmp_path):
    writer = ShardedSafetensorsWriter(tmp_path, max_shard_bytes=10_000)
    for name, tensor in _tensors().items():
        writer.add(name, tensor)
    files = writer.close()
    assert [f.name for f in files] == ["model.safetensors"]
    loaded = load_file(tmp_path / "model.safetensors")
    assert all(torch.equal(loaded[k], v) for k, v in _tensors().items())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]


def test_shards_respect_the_size_and_the_index_maps_every_tensor(tmp_path):
    writer = ShardedSafetensorsWriter(tmp_path, max_shard_bytes=900)  # two 400-byte tensors per shard
    for name, tensor in _tensors().items():
        writer.add(name, tensor)
    files = writer.close()
    assert [f.name for f in files] == [
        "model-00001-of-00003.safetensors",
        "model-00002-of-00003.safetensors",
        "model-00003-of-00003.safetensors",
        "model.safetensors.index.json",
    ]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 5 * 400
    assert index["weight_map"] == {
        "w0": "model-00001-of-00003.safetensors",
        "w1": "model-00001-of-00003.safetensors",
        "w2": "model-00002-of-00003.safetensors",
        "w3": "model-00002-of-00003.safetensors",
        "w4": "model-00003-of-00003.safetensors",
    }
    for name, tensor in _tensors().items():
        assert torch.equal(load_file(tmp_path / index["weight_map"][name])[name], tensor)


def test_duplicate_name_is_refused(tmp_path):
    writer = ShardedSafetensorsWriter(tmp_path, max_shard_bytes=500)
    writer.add("w", torch.zeros(200))
    with pytest.raises(ValueError, match="'w' was given twice"):
        writer.add("w", torch.zeros(2))


@pytest.mark.parametrize(
    ("text", "expected"),
    [("5GB", 5 * 10**9), ("200MiB", 200 * 2**20), ("1000", 1000), ("1.5KB", 1500), (7, 7)],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


def test_parse_size_rejects_unknown_units():
    with pytest.raises(ValueError, match="'5 parsecs' is not a size"):
        parse_size("5 parsecs")

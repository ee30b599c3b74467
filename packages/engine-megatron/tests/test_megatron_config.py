"""MegatronEngineConfig validation, plugin registration and CPU refusals (single process, no megatron groups)."""

from __future__ import annotations

import pytest
from drivetrain_engine_core.backend import ConfigError, ModelConfig, RowPadding
from drivetrain_engine_core.job import config_from_dict
from drivetrain_engine_megatron import MegatronEngineConfig, plugin


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"tensor_model_parallel_size": 0}, "tensor_model_parallel_size must be an integer >= 1"),
        ({"virtual_pipeline_model_parallel_size": 2}, "needs pipeline_model_parallel_size >= 2"),
        ({"sequence_parallel": True}, "sequence_parallel=True needs tensor_model_parallel_size > 1"),
        ({"make_vocab_size_divisible_by": 0}, "make_vocab_size_divisible_by must be >= 1"),
        ({"entropy_chunk_size": 0}, "entropy_chunk_size must be an integer >= 1"),
        ({"initial_loss_scale": 0.5}, "initial_loss_scale must be >= 1"),
    ],
)
def test_megatron_config_refuses_impossible_layouts(values, message):
    with pytest.raises(ConfigError, match=message):
        MegatronEngineConfig(**values)


def test_megatron_config_from_yaml_values():
    config = config_from_dict(
        MegatronEngineConfig, {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2}
    )
    assert config.backend == "megatron"
    assert config.model_parallel_size == 4
    assert config.data_parallel_size(8) == 2
    with pytest.raises(ConfigError, match=r"world size 6 is not divisible by .* = 4; launch a multiple of 4"):
        config.data_parallel_size(6)


class _Recorder:
    def __init__(self):
        self.calls = []

    def register(self, *args, **kwargs):
        self.calls.append((args, kwargs))


def test_megatron_plugin_registers_both_model_types_and_the_merger():
    engines, mergers = _Recorder(), _Recorder()
    plugin.register_engines(engines)
    plugin.register_checkpoint_mergers(mergers)
    assert sorted(kw["model_type"] for _, kw in engines.calls) == ["language_model", "value_model"]
    assert all(
        kw["backend"] == "megatron" and set(kw["devices"]) == {"cpu", "cuda"} for _, kw in engines.calls
    )
    assert all(kw["engine"] == "drivetrain_engine_megatron.engine:MegatronEngine" for _, kw in engines.calls)
    assert mergers.calls == [(("megatron", "drivetrain_engine_megatron.merger:MegatronCheckpointMerger"), {})]


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"context_parallel_size": 2}, "context_parallel_size=2 needs Transformer Engine attention, which"),
        ({"param_offload": True}, "param_offload / optimizer_offload are not implemented"),
        # A ConfigError (one line from the CLI), not a ValueError traceback: TP2 on one rank.
        (
            {"tensor_model_parallel_size": 2},
            "world size 1 is not divisible by .* = 2; launch a multiple of 2",
        ),
    ],
)
def test_megatron_engine_refuses_what_cpu_cannot_run(values, message, tmp_path):
    from drivetrain_engine_megatron.engine import MegatronEngine

    engine = MegatronEngine(
        model_config=ModelConfig(path=str(tmp_path)), engine_config=MegatronEngineConfig(**values)
    )
    with pytest.raises(ConfigError, match=message):
        engine.initialize()


def test_sequence_parallelism_needs_packed_rows(tmp_path):
    """Megatron splits a packed row along its tokens (padded to a multiple of TP by core's ``RowPadding``);
    padded rows would need their width padded too, so they are refused with the fix (on any device)."""
    from drivetrain_engine_megatron.engine import MegatronEngine

    engine = MegatronEngine(
        model_config=ModelConfig(path=str(tmp_path), use_remove_padding=False),
        engine_config=MegatronEngineConfig(tensor_model_parallel_size=2, sequence_parallel=True),
    )
    with pytest.raises(
        ConfigError, match=r"sequence_parallel=True splits packed rows.*use_remove_padding=True"
    ):
        engine.initialize()
    packed = MegatronEngine(
        model_config=ModelConfig(path=str(tmp_path)),
        engine_config=MegatronEngineConfig(tensor_model_parallel_size=2, sequence_parallel=True),
    )
    assert packed._sequence_split() == RowPadding(2)


def test_packed_half_precision_rows_are_refused_before_ampere(monkeypatch, tmp_path):
    """torch's flash kernel (packed rows in bf16/fp16 on CUDA) needs compute capability 8.0: a V100 or T4
    would fail inside the first forward. The engine refuses at build, naming the padded rows or float32."""
    import torch
    from drivetrain_engine_megatron.engine import MegatronEngine

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    engine = MegatronEngine(
        model_config=ModelConfig(path=str(tmp_path)),
        engine_config=MegatronEngineConfig(device="cuda", param_dtype="float16"),
    )
    with pytest.raises(ConfigError, match=r"compute capability 8\.0.*use_remove_padding=False"):
        engine._refuse_unsupported()  # what initialize() runs first once the GPUs are found

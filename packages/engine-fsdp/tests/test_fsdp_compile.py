"""``compile_layers``: per-decoder-layer ``torch.compile`` agrees with eager; refused where it cannot run.

NOTE: the agreement test needs a GPU: the first inductor compilation of even the tiny model's layer took 93 s
of a shared 2-core CPU here, over the budget of a CPU test, so it runs in the GPU lane.
"""

from __future__ import annotations

import pytest
from drivetrain_engine_core.backend import ConfigError, ModelConfig, OptimizerConfig
from drivetrain_engine_core.job import MicroBatchConfig
from drivetrain_engine_core.testing import make_tiny_model_dir, random_batch
from drivetrain_engine_core.testing.device import requires_cuda
from drivetrain_engine_core.testing.losses import token_mean_nll
from drivetrain_engine_fsdp.config import FSDPEngineConfig
from drivetrain_engine_fsdp.engine import FSDPEngine


def test_refused_on_cpu_without_a_compiler(monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    with pytest.raises(ConfigError, match="compile_layers=True on device 'cpu' needs a C\\+\\+ compiler"):
        FSDPEngineConfig(device="cpu", compile_layers=True)


def train_two_steps(model_dir, compile_layers):
    engine = FSDPEngine(
        model_config=ModelConfig(path=str(model_dir)),
        engine_config=FSDPEngineConfig(
            device="cuda", micro_batch=MicroBatchConfig(micro_batch_size=2), compile_layers=compile_layers
        ),
        optimizer_config=OptimizerConfig(lr=1e-3, clip_grad=1.0, weight_decay=0.0),
    )
    engine.initialize()
    figures = []
    with engine.train_mode():
        for seed in (1, 2):
            batch = random_batch(vocab_size=64, prompt_lengths=[3, 5], response_lengths=[4, 6], seed=seed)
            output = engine.train_batch(batch, token_mean_nll)
            figures += [output.loss, output.metrics["grad_norm"]]
    return figures


@requires_cuda
def test_compiled_layers_agree_with_eager(tmp_path):
    model_dir = make_tiny_model_dir(tmp_path / "qwen2", arch="qwen2")
    eager, compiled = train_two_steps(model_dir, False), train_two_steps(model_dir, True)
    assert compiled == pytest.approx(eager, rel=1e-5, abs=1e-5)


def test_compiled_attention_is_not_specialised_on_the_number_of_sequences(monkeypatch):
    """On the flash path a compiled layer must serve every micro-batch shape with one graph (two frames: the
    first, then one with dynamic sizes). Checking ``sequence_lengths is None`` guarded it on the tuple's length,
    so each new number of sequences recompiled it, and after torch's limit of eight it ran eager.

    The flash kernel needs CUDA, so here it is replaced by a stand-in with the kernel's inputs (``cu_seqlens``
    and ``max_seqlen``, no host lengths); torch's ``eager`` backend counts the frames without compiling."""
    import torch
    from drivetrain_engine_core import _packed_attention as packed_attention
    from drivetrain_engine_fsdp.attention import varlen_attention_forward
    from torch._dynamo.testing import CompileCounter

    def kernel_stand_in(query, key, value, cu_seqlens, max_seqlen, scale, groups, window):
        return query * max_seqlen + cu_seqlens[-1]

    monkeypatch.setattr(packed_attention, "_flash_applies", lambda query, scale, dropout, window: True)
    monkeypatch.setattr(packed_attention, "_torch_varlen", kernel_stand_in)
    torch._dynamo.reset()
    counter = CompileCounter()
    attention = torch.compile(varlen_attention_forward, backend=counter)
    for count in range(1, 12):
        lengths = tuple(range(2, count + 2))
        total = sum(lengths)
        query, key, value = (
            torch.randn(1, 4, total, 8),
            torch.randn(1, 2, total, 8),
            torch.randn(1, 2, total, 8),
        )
        cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        output, _ = attention(
            torch.nn.Module(),
            query,
            key,
            value,
            None,
            cu_seq_lens_q=cu_seqlens,
            max_length_q=max(lengths),
            sequence_lengths=lengths,
        )
        expected = query.transpose(1, 2) * max(lengths) + total
        torch.testing.assert_close(output, expected)
    torch._dynamo.reset()
    assert counter.frame_count == 2


@pytest.mark.parametrize(
    ("device", "param_dtype", "warned"),
    [
        ("cpu", "float32", True),
        ("cuda", "float32", True),
        ("cuda", "bfloat16", False),
        ("cuda:1", "float16", False),
    ],
)
def test_compiled_layers_on_the_per_sequence_attention_path_are_warned_about(
    caplog, device, param_dtype, warned
):
    """Off the flash path every new number of sequences recompiles a compiled layer (eight, then it runs eager),
    with no word of it; the default float32 on a GPU takes that path."""
    from drivetrain_engine_fsdp.attention import warn_compiled_per_sequence_attention

    warn_compiled_per_sequence_attention(True, device, param_dtype)
    warn_compiled_per_sequence_attention(False, device, param_dtype)
    expected = (
        f"compile_layers=True with packed attention per sequence (device {device}, param_dtype {param_dtype})"
    )
    assert [expected in record.getMessage() for record in caplog.records] == ([True] if warned else [])

"""Attention options of Hugging Face models that packed attention must honour, or refuse.

- A sliding window (Mistral, Qwen2 with ``use_sliding_window``, Gemma's local layers): each token attends to
  itself and the ``sliding_window - 1`` tokens before it. The packed path ignored it, so sequences longer than
  the window were scored as with full attention.
- Soft-capped attention logits (Gemma 2): neither packed attention nor SDPA applies them; only transformers'
  eager attention does, so the engine refuses the others with that fix.
"""

from __future__ import annotations

import pytest
import torch
from drivetrain_engine_core.backend import ConfigError, ModelConfig
from drivetrain_engine_core.job import MicroBatchConfig
from drivetrain_engine_core.testing import make_tiny_model_dir, random_batch, reference_log_probs
from drivetrain_engine_fsdp.config import FSDPEngineConfig
from drivetrain_engine_fsdp.engine import FSDPEngine
from transformers import AutoConfig, AutoModelForCausalLM

WINDOW = 3


def _log_probs(model_dir, batch, **engine_options) -> torch.Tensor:
    engine = FSDPEngine(
        model_config=ModelConfig(path=str(model_dir)),
        engine_config=FSDPEngineConfig(micro_batch=MicroBatchConfig(micro_batch_size=4), **engine_options),
        optimizer_config=None,
    )
    engine.initialize()
    with engine.eval_mode():
        return engine.infer_batch(batch).outputs["log_probs"].values()


@pytest.mark.parametrize("attention_backend", ["varlen", "sdpa", "eager"])
def test_sliding_window_matches_hugging_face(tmp_path, attention_backend):
    model_dir = make_tiny_model_dir(
        tmp_path / "windowed", use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0
    )
    batch = random_batch(vocab_size=64, prompt_lengths=[3, 5, 2], response_lengths=[4, 6, 1], seed=0)
    expected = reference_log_probs(model_dir, batch).values()
    full_attention = reference_log_probs(make_tiny_model_dir(tmp_path / "full"), batch).values()
    assert (expected - full_attention).abs().max() > 1e-3  # the window changes the numbers

    log_probs = _log_probs(model_dir, batch, attention_backend=attention_backend)

    torch.testing.assert_close(log_probs, expected, atol=1e-5, rtol=0)


def test_soft_capped_attention_needs_eager(tmp_path):
    config = AutoConfig.for_model(
        "gemma2", vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, attn_logit_softcapping=50.0,
    )  # fmt: skip
    model_dir = tmp_path / "gemma2"
    AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)
    engine = FSDPEngine(
        model_config=ModelConfig(path=str(model_dir)),
        engine_config=FSDPEngineConfig(micro_batch=MicroBatchConfig(micro_batch_size=2)),
        optimizer_config=None,
    )
    with pytest.raises(ConfigError, match=r"attn_logit_softcapping=50\.0.*engine\.attention_backend='eager'"):
        engine.initialize()
    # eager applies the cap: the engine equals transformers' eager model.
    batch = random_batch(vocab_size=64, prompt_lengths=[3, 5], response_lengths=[4, 2], seed=0)
    expected = reference_log_probs(model_dir, batch, attn_implementation="eager").values()
    log_probs = _log_probs(model_dir, batch, attention_backend="eager")
    torch.testing.assert_close(log_probs, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize(("capability", "param_dtype", "refused"), [
    ((7, 5), "float16", True),  # T4: the flash kernel would fail in the first forward
    ((7, 0), "bfloat16", True),
    ((7, 5), "float32", False),  # SDPA per sequence: no flash kernel
    ((8, 0), "bfloat16", False),
])  # fmt: skip
def test_packed_attention_in_half_precision_needs_ampere(monkeypatch, capability, param_dtype, refused):
    from drivetrain_engine_fsdp.attention import check_flash_support

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    if refused:
        with pytest.raises(ConfigError, match=r"Tesla T4.*attention_backend='sdpa'"):
            check_flash_support("cuda", param_dtype)
    else:
        check_flash_support("cuda", param_dtype)


def test_packed_row_lengths_reach_the_layers_as_one_value_fsdp_hooks_do_not_walk():
    """FSDP2 walks every wrapped layer's forward keywords (input cast, backward-hook registration); with the
    lengths as a tuple it visited one integer per sequence, in every layer of every micro-batch, which cost the
    embedded SFT job more CPU than its attention. The walk must not grow with the number of sequences."""
    from drivetrain_engine_core.backend import PackedRow
    from drivetrain_engine_core.kit import SequenceLengths
    from drivetrain_engine_fsdp.inputs import packed_row_kwargs
    from torch.distributed.fsdp import _common_utils

    def walked_objects(count: int) -> int:
        lengths = (3,) * count
        row = PackedRow(
            input_ids=torch.zeros(1, 3 * count, dtype=torch.long),
            position_ids=torch.arange(3).repeat(count)[None],
            cu_seqlens=torch.arange(0, 3 * count + 1, 3, dtype=torch.int32),
            max_seqlen=3,
            offsets=torch.arange(0, 3 * count + 1, 3),
            lengths=lengths,
        )
        kwargs = packed_row_kwargs(row)
        assert isinstance(kwargs["sequence_lengths"], SequenceLengths)
        assert kwargs["sequence_lengths"].values == lengths
        visits = []
        walk = _common_utils._collect_grad_tensors

        def counting(obj, out, _depth=0):
            visits.append(obj)
            return walk(obj, out, _depth)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(_common_utils, "_collect_grad_tensors", counting)
            _common_utils.collect_grad_tensors(((), kwargs))
        return len(visits)

    assert walked_objects(2) == walked_objects(64)

"""Merging hand-written DCP steps (the FSDP engine's key convention) and comparing with the source models.

The reference is the plain Hugging Face / PEFT model whose state dict was saved; the merged directory is
loaded back with ``from_pretrained`` and must give the same logits.
"""

from __future__ import annotations

import json

import torch
from drivetrain_ckpt_tools.merge import MergeOptions, merge_checkpoint
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

TOLERANCE = 1e-5


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def test_full_model_merge_matches_source_logits_and_copies_side_files(
    synthetic_step, tmp_path, source_dir, source_model, probe_ids
):
    result = merge_checkpoint(synthetic_step, tmp_path / "hf", MergeOptions(max_shard_bytes=30_000))
    assert result.kind == "model"
    assert "model.safetensors.index.json" in result.files
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "config.json"):
        assert name in result.files
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == (source_dir / "tokenizer.json").read_bytes()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        assert _max_diff(merged(probe_ids).logits, source_model(probe_ids).logits) == 0.0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "hf"]


def test_the_config_keeps_the_sources_format_and_names_the_dtype_written(
    tmp_path, source_dir, source_model, write_step
):
    """The merge re-saved the config through transformers 5, which moves ``rope_theta`` into ``rope_parameters``:
    transformers 4 then used the default RoPE base (10,000 instead of Qwen2's 1,000,000). And float32 weights
    went out under the source's ``torch_dtype: bfloat16``, so ``dtype="auto"`` rounded them on load."""
    import shutil

    from safetensors import safe_open

    source = tmp_path / "v4_source"
    shutil.copytree(source_dir, source)
    config = json.loads((source / "config.json").read_text())
    rope = config.pop("rope_parameters", None) or {}
    config.pop("dtype", None)
    config.update(rope_theta=rope.get("rope_theta", 1e6), torch_dtype="bfloat16")
    (source / "config.json").write_text(json.dumps(config))
    step = write_step(tmp_path / "ckpt", 1, source_model, model_path=source)
    for dtype, written in ((None, torch.float32), ("bfloat16", torch.bfloat16)):
        target = tmp_path / f"merged_{dtype}"
        merge_checkpoint(step, target, MergeOptions(dtype=dtype))
        merged = json.loads((target / "config.json").read_text())
        assert merged["torch_dtype"] == str(written).removeprefix("torch.")
        assert "rope_parameters" not in merged and "dtype" not in merged
        assert {k: v for k, v in merged.items() if k != "torch_dtype"} == {
            k: v for k, v in config.items() if k != "torch_dtype"
        }
        with safe_open(target / "model.safetensors", "pt") as handle:
            assert {handle.get_tensor(k).dtype for k in handle.keys()} == {written}  # noqa: SIM118


def test_merge_from_root_follows_latest(tmp_path, source_dir, source_model, write_step):
    root = tmp_path / "ckpt"
    write_step(root, 1, source_model, model_path=source_dir)
    (root / "latest").write_text("global_step_1")
    result = merge_checkpoint(root, tmp_path / "hf")
    assert result.step_dir == root / "global_step_1"


def test_lora_step_becomes_a_peft_adapter_dir_and_a_merged_model(
    tmp_path, source_dir, probe_ids, lora_model, write_step
):
    from peft import PeftModel

    model, lora = lora_model
    step = write_step(tmp_path / "ckpt", 2, model, model_path=source_dir, lora=lora)
    with torch.no_grad():
        expected = model(input_ids=probe_ids).logits

    adapter = merge_checkpoint(step, tmp_path / "adapter")
    assert adapter.kind == "adapter"
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(adapter.files)
    assert not any(name.startswith("model") for name in adapter.files)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (4, 8.0, ["q_proj", "v_proj"])
    base = AutoModelForCausalLM.from_pretrained(source_dir, dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    with torch.no_grad():
        assert _max_diff(loaded(input_ids=probe_ids).logits, expected) < TOLERANCE

    merged = merge_checkpoint(step, tmp_path / "merged", MergeOptions(merge_lora=True))
    assert merged.kind == "model"
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    with torch.no_grad():
        diff = _max_diff(plain(probe_ids).logits, expected)
    assert diff < TOLERANCE
    assert not any("lora" in name or "base_layer" in name for name in plain.state_dict())


def test_an_all_linear_adapter_loads_in_peft(tmp_path, source_dir, probe_ids, write_step):
    """``lora.target_modules=[all-linear]`` was written as the list ``["all-linear"]``, which PEFT reads as a
    module of that name ("Target modules {'all-linear'} not found"); PEFT expands only the bare string."""
    from peft import LoraConfig, PeftModel, get_peft_model

    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(source_dir, dtype=torch.float32),
        LoraConfig(r=4, lora_alpha=8.0, target_modules="all-linear"),
    )
    with torch.no_grad():  # PEFT starts lora_B at zero: a wrongly loaded adapter would not show
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.1, generator=torch.Generator().manual_seed(len(name)))
    lora = {"rank": 4, "alpha": 8.0, "target_modules": ["all-linear"], "dropout": 0.0}
    step = write_step(tmp_path / "ckpt", 2, model.eval(), model_path=source_dir, lora=lora)
    merge_checkpoint(step, tmp_path / "adapter")
    base = AutoModelForCausalLM.from_pretrained(source_dir, dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    with torch.no_grad():
        assert _max_diff(loaded(input_ids=probe_ids).logits, model(input_ids=probe_ids).logits) < TOLERANCE


def test_value_model_with_lora_and_trained_head(
    tmp_path, value_source_dir, probe_ids, value_lora_model, write_step
):
    model, lora = value_lora_model
    with torch.no_grad():
        expected = model(input_ids=probe_ids).logits
    step = write_step(
        tmp_path / "ckpt", 3, model, model_path=value_source_dir, model_type="value_model", lora=lora
    )
    merge_checkpoint(step, tmp_path / "merged", MergeOptions(merge_lora=True))
    config = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForTokenClassification"]
    plain = AutoModelForTokenClassification.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    with torch.no_grad():
        assert _max_diff(plain(probe_ids).logits, expected) < TOLERANCE

    merge_checkpoint(step, tmp_path / "adapter")
    adapter_config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert adapter_config["modules_to_save"] == ["score"]


def test_value_model_from_causal_lm_source_is_written_as_token_classification(
    tmp_path, source_dir, write_step
):
    """A critic built from an LM directory: the merged config gets the token-classification head and 1 label."""
    critic = AutoModelForTokenClassification.from_pretrained(
        source_dir, num_labels=1, dtype=torch.float32
    ).eval()
    step = write_step(tmp_path / "ckpt", 1, critic, model_path=source_dir, model_type="value_model")
    merge_checkpoint(step, tmp_path / "merged")
    merged = AutoModelForTokenClassification.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    ids = torch.arange(12)[None]
    with torch.no_grad():
        assert _max_diff(merged(ids).logits, critic(ids).logits) == 0.0
    assert merged.config.num_labels == 1
    assert merged.config.architectures == ["Qwen2ForTokenClassification"]


def test_tied_embeddings_are_written_once_and_retied_on_load(tmp_path, write_step, probe_ids):
    from drivetrain_engine_core.testing.models import make_tiny_model_dir

    source = make_tiny_model_dir(tmp_path / "tied", tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    step = write_step(tmp_path / "ckpt", 1, model, model_path=source)
    merge_checkpoint(step, tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    with torch.no_grad():
        assert _max_diff(merged(probe_ids).logits, model(probe_ids).logits) == 0.0
    from safetensors import safe_open

    with safe_open(tmp_path / "merged" / "model.safetensors", "pt") as handle:
        assert "lm_head.weight" not in list(handle.keys())


def test_options_an_adapter_output_ignores_are_warned_about(
    tmp_path, source_dir, lora_model, write_step, caplog
):
    model, lora = lora_model
    step = write_step(tmp_path / "ckpt", 2, model, model_path=source_dir, lora=lora)
    with caplog.at_level("WARNING"):
        merge_checkpoint(step, tmp_path / "adapter", MergeOptions(dtype="bfloat16"))
    assert "--dtype and --max-shard-size apply to full models" in caplog.text

"""Fixtures for ckpt-tools tests: tiny source models and DCP checkpoint steps written without an engine.

A "synthetic" step is what the FSDP engine writes, built by hand: ``dcp.save`` of a plain Hugging Face (or
PEFT) model's ``state_dict`` into ``model/`` plus a manifest. It isolates the merger from engine code; the
engine-written steps are covered in ``test_ckpt_engine_merge.py``.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from drivetrain_engine_core._checkpoint import write_manifest
from drivetrain_engine_core.job import Manifest
from drivetrain_engine_core.testing.models import make_tiny_model_dir

LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj"], "dropout": 0.0}


def write_synthetic_step(
    root: Path, global_step: int, model: torch.nn.Module, *, model_path: Path, **manifest
) -> Path:
    """Save ``model``'s state dict with DCP as ``<root>/global_step_<N>/model`` and write the manifest."""
    step = root / f"global_step_{global_step}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming the intent is to save in a single process"
        dcp.save(model.state_dict(), checkpoint_id=str(step / "model"))
    fields = {"backend": "fsdp", "world_size": 1, "model_type": "language_model", **manifest}
    write_manifest(step, Manifest(global_step=global_step, model_path=str(model_path), **fields))
    return step


def randomize_lora_b(model: torch.nn.Module, seed: int = 7) -> None:
    """PEFT starts lora_B at zero (a no-op adapter); give it values so a wrong merge shows in the logits."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)


@pytest.fixture(scope="session")
def source_dir(tmp_path_factory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("src") / "lm")


@pytest.fixture(scope="session")
def value_source_dir(tmp_path_factory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("src") / "critic", model_type="value_model", seed=3)


@pytest.fixture(scope="session")
def source_model(source_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(source_dir, dtype=torch.float32).eval()


@pytest.fixture
def synthetic_step(tmp_path, source_dir, source_model) -> Path:
    return write_synthetic_step(tmp_path / "ckpt", 5, source_model, model_path=source_dir)


@pytest.fixture
def probe_ids() -> torch.Tensor:
    return torch.randint(0, 100, (2, 11), generator=torch.Generator().manual_seed(0))


@pytest.fixture
def write_step():
    """The :func:`write_synthetic_step` helper (test modules cannot import conftest under importlib mode)."""
    return write_synthetic_step


@pytest.fixture
def lora_model(source_dir):
    """A PEFT LoRA model over the tiny LM with non-zero adapters, and the manifest's LoRA dict."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(source_dir, dtype=torch.float32)
    config = LoraConfig(r=LORA["rank"], lora_alpha=LORA["alpha"], target_modules=LORA["target_modules"])
    model = get_peft_model(base, config)
    randomize_lora_b(model)
    return model.eval(), dict(LORA)


@pytest.fixture
def value_lora_model(value_source_dir):
    """A PEFT LoRA value model whose ``score`` head is trained in full (``modules_to_save``), as the engine does."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForTokenClassification

    base = AutoModelForTokenClassification.from_pretrained(value_source_dir, dtype=torch.float32)
    config = LoraConfig(
        r=LORA["rank"],
        lora_alpha=LORA["alpha"],
        target_modules=LORA["target_modules"],
        modules_to_save=["score"],
    )
    model = get_peft_model(base, config)
    randomize_lora_b(model)
    with torch.no_grad():
        model.base_model.model.score.modules_to_save["default"].weight.add_(1.0)  # the head was trained
    return model.eval(), dict(LORA)

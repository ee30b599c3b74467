"""Trained-looking weight versions of a tiny model, their streams and their log-probs, for the rollout kit.

A version is a full Hugging Face state dict (every weight moved by seeded noise, as a training step moves
it) or LoRA adapters under their PEFT names. Its reference is independent of any rollout: the state saved as
a model directory, run by the plain Hugging Face model (:mod:`.reference`) on each response.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from drivetrain_engine_core._checkpoint import PEFT_PREFIX
from drivetrain_engine_core._data.batch import make_batch
from drivetrain_engine_core._handoff import LoraMode, SentVersions, WeightBucket
from drivetrain_engine_core._rollout import RolloutOutput
from drivetrain_engine_core.testing.reference import load_reference_model, reference_log_probs

State = dict[str, torch.Tensor]
LORA_RANK, LORA_ALPHA, LORA_TARGETS = 4, 8.0, ("q_proj", "v_proj")


def moved(state: State, seed: int, names: Sequence[str] | None = None, scale: float = 0.02) -> State:
    """``state`` with seeded noise added to the floating-point tensors in ``names`` (all when ``None``)."""
    generator = torch.Generator().manual_seed(seed)
    chosen = set(state if names is None else names)
    return {
        name: tensor + scale * torch.randn(tensor.shape, generator=generator)
        if name in chosen and tensor.is_floating_point()
        else tensor.clone()
        for name, tensor in state.items()
    }


def base_state(model_dir: Path) -> State:
    return {name: tensor.clone() for name, tensor in load_reference_model(model_dir).state_dict().items()}


def save_policy(model_dir: Path, state: State, target: Path) -> Path:
    """``state`` saved as a Hugging Face model directory of ``model_dir``'s architecture (the actor's weights)."""
    model: Any = load_reference_model(model_dir)
    model.load_state_dict(state)
    model.save_pretrained(target, safe_serialization=True)
    return target


def lora_adapters(model_dir: Path, seed: int, layers: Sequence[int] | None = None) -> State:
    """PEFT-named ``lora_A``/``lora_B`` tensors for every targeted projection (of ``layers``: all when ``None``)."""
    generator = torch.Generator().manual_seed(seed)
    adapters: State = {}
    for name, tensor in base_state(model_dir).items():
        module = name.removesuffix(".weight")
        if not name.endswith(".weight") or module.split(".")[-1] not in LORA_TARGETS:
            continue
        if layers is not None and int(module.split(".")[2]) not in layers:
            continue
        out_features, in_features = tensor.shape
        adapters[f"{PEFT_PREFIX}{module}.lora_A.weight"] = torch.randn(
            LORA_RANK, in_features, generator=generator
        )
        adapters[f"{PEFT_PREFIX}{module}.lora_B.weight"] = 0.1 * torch.randn(
            out_features, LORA_RANK, generator=generator
        )
    return adapters


def folded(state: State, adapters: State) -> State:
    """``state`` with ``adapters`` folded in: ``W + (B @ A in float32) * alpha / r``, PEFT's merge."""
    merged = dict(state)
    for name in adapters:
        if name.endswith(".lora_A.weight"):
            module = name.removesuffix(".lora_A.weight")
            weight = module.removeprefix(PEFT_PREFIX) + ".weight"
            update = adapters[f"{module}.lora_B.weight"].float() @ adapters[name].float()
            merged[weight] = state[weight] + update.to(state[weight].dtype) * (LORA_ALPHA / LORA_RANK)
    return merged


def stream(
    sender: SentVersions,
    state: State,
    version: int,
    *,
    base_version: int | None = None,
    lora: LoraMode = "merged",
    dtype: torch.dtype | None = None,
    device: str = "cpu",
    bucket_bytes: int = 4096,
) -> list[WeightBucket]:
    """The buckets of ``state`` as an engine on ``device`` streams them (4 KiB each by default, so a tiny model
    spans many)."""
    config = None
    if lora == "adapter":
        from drivetrain_engine_core._checkpoint.peft import peft_adapter_config

        config = peft_adapter_config(
            {"rank": LORA_RANK, "alpha": LORA_ALPHA, "target_modules": list(LORA_TARGETS)},
            model_type="language_model",
            model_path="tiny",
        )
    return list(
        sender.stream(
            ((name, tensor.to(device)) for name, tensor in state.items()),
            version=version,
            base_version=base_version,
            dtype=dtype,
            lora=lora,
            bucket_bytes=bucket_bytes,
            adapter_config=config,
        )
    )


def actor_log_probs(
    policy_dir: Path,
    prompts: Sequence[Sequence[int]],
    output: RolloutOutput,
    temperature: float,
    *,
    dtype: torch.dtype = torch.float32,
) -> list[torch.Tensor]:
    """Each response's per-token log-probs under the policy at ``policy_dir``, by the plain HF model in ``dtype``."""
    rows = [list(prompts[i // output.n]) for i in range(len(output.responses))]
    batch = make_batch(
        [torch.tensor(p + r.tolist()) for p, r in zip(rows, output.responses, strict=True)],
        loss_mask=[
            torch.tensor([0] * len(p) + [1] * len(r)).bool()
            for p, r in zip(rows, output.responses, strict=True)
        ],
    )
    values = reference_log_probs(policy_dir, batch, temperature, dtype=dtype).unbind()
    return [value[len(prompt) :] for prompt, value in zip(rows, values, strict=True)]

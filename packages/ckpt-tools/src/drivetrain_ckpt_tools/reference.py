"""Score sequences with a merged directory loaded by plain transformers: the independent side of ``verify``.

Outputs follow the engine's per-token alignment (docs/architecture.md §7.1): position ``i`` is scored by
the logits at ``i - 1`` and position 0 holds 0. Each sequence runs alone, unpadded, so nothing here shares
code or tricks (packing, masking) with the engines it checks.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from drivetrain_engine_core.backend import CheckpointError, CheckpointMerger

from .lora import ADAPTER_CONFIG


def load_merged(directory: Path, merger: CheckpointMerger, *, device: str = "cpu") -> torch.nn.Module:
    """Load a merged model directory, or a PEFT adapter directory on top of the checkpoint's source model.

    Raises:
        CheckpointError: transformers or peft cannot load it (not a merge of this checkpoint's model, peft not
            installed, a device this machine does not have); the message keeps their first line.
    """
    adapter = (directory / ADAPTER_CONFIG).is_file()
    try:
        return _load(directory, merger, adapter=adapter).to(device).eval()
    except (OSError, ValueError, RuntimeError, ImportError, AssertionError) as e:
        first_line = (str(e).strip().splitlines() or [type(e).__name__])[0]
        what = f"{directory} as a PEFT adapter on {merger.manifest.model_path}" if adapter else str(directory)
        raise CheckpointError(
            f"cannot load {what} on {device}: {first_line}. Check that it was merged from this checkpoint "
            "(drivetrain ckpt merge SRC DST), that --model-path names the model training started from, and that "
            "--device exists here."
        ) from e


def _load(directory: Path, merger: CheckpointMerger, *, adapter: bool) -> torch.nn.Module:
    import transformers

    auto_class = getattr(transformers, merger.auto_class)
    common = {"dtype": torch.float32, "trust_remote_code": merger.manifest.trust_remote_code}
    if not adapter:
        return auto_class.from_pretrained(directory, **common)
    from peft import PeftModel

    extra = {"num_labels": 1} if merger.manifest.model_type == "value_model" else {}
    base = auto_class.from_pretrained(merger.manifest.model_path, **common, **extra)
    return PeftModel.from_pretrained(base, directory)


@torch.no_grad()
def reference_outputs(
    directory: Path, merger: CheckpointMerger, sequences: Sequence[torch.Tensor], *, device: str = "cpu"
) -> dict[str, list[torch.Tensor]]:
    """Per-sequence ``log_probs`` and ``entropy`` (language model) or ``values`` (value model), float32 on CPU."""
    model = load_merged(directory, merger, device=device)
    outputs: dict[str, list[torch.Tensor]] = {}
    for ids in sequences:
        head = model(input_ids=ids[None].to(device), use_cache=False).logits[0].float().cpu()
        for key, value in _score(head, ids, merger.manifest.model_type).items():
            outputs.setdefault(key, []).append(value)
    return outputs


def _score(head: torch.Tensor, ids: torch.Tensor, model_type: str) -> dict[str, torch.Tensor]:
    """Per-token outputs of one sequence from its ``(length, vocab)`` logits or ``(length, 1)`` scores."""
    if model_type == "value_model":
        return {"values": _shift(head[:, 0])}
    log_softmax = torch.log_softmax(head, dim=-1)
    predicted = log_softmax[:-1].gather(-1, ids[1:, None]).squeeze(-1)
    entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    return {"log_probs": torch.cat([torch.zeros(1), predicted]), "entropy": _shift(entropy)}


def _shift(per_position: torch.Tensor) -> torch.Tensor:
    """Move the output read at position ``i - 1`` to position ``i``; position 0 gets 0."""
    return torch.cat([torch.zeros(1), per_position[:-1]])


__all__ = ["load_merged", "reference_outputs"]

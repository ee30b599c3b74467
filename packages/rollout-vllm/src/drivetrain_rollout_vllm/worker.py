"""What runs inside vLLM's worker (through ``LLM.collective_rpc``): in-place reloads and weight read-back.

These are plain functions of the worker, so they run wherever vLLM put its model (in this process or in vLLM's
engine process) and travel by reference to this importable module.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def reload(worker: Any, weights: Sequence[tuple[str, torch.Tensor]]) -> None:
    """Load ``weights`` (Hugging Face names, checkpoint layout) in place through vLLM's reload path.

    NOTE: the model's ``load_weights`` alone is not enough: vLLM processes weights after loading (the CPU
    linears pack theirs into oneDNN and drop the parameter), and its reload path restores the checkpoint
    layout, loads, and processes again. A fused layer (``qkv_proj``) must receive all its parts in one call.
    """
    worker.model_runner.reload_weights(weights_iterator=list(weights), is_checkpoint_format=True)


def served_weights(worker: Any, names: Sequence[str]) -> dict[str, torch.Tensor]:
    """The tensors the model computes with under each Hugging Face name, read back from vLLM's layers.

    A fused layer's part is cut out of it (``q_proj`` from ``qkv_proj``); a linear whose weight vLLM packed
    into a CPU kernel is read back through that kernel (it multiplies an identity matrix, which gives every
    weight exactly); a padded vocabulary is cut to the checkpoint's rows.
    """
    model = worker.model_runner.get_model()
    packed = getattr(model, "packed_modules_mapping", {})
    served = {}
    for name in names:
        module_name, _, leaf = name.rpartition(".")
        parent, _, short = module_name.rpartition(".")
        fused = next((f for f, parts in packed.items() if short in parts), None)
        module = model.get_submodule(f"{parent}.{fused}" if fused else module_name)
        tensor = _full_parameter(module, leaf)
        if fused:
            sizes = list(module.output_sizes)
            index = packed[fused].index(short)
            tensor = tensor.narrow(0, sum(sizes[:index]), sizes[index])
        served[name] = tensor.detach().cpu().clone()
    vocab = model.config.vocab_size if hasattr(model, "config") else None
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in served and vocab is not None:
            served[name] = served[name][:vocab]
    return served


def _full_parameter(module: Any, leaf: str) -> torch.Tensor:
    """``module``'s parameter ``leaf``, or, for a weight a CPU kernel holds (vLLM left an empty parameter),
    the kernel applied to the identity: ``I @ W.T`` is ``W.T`` exactly, each output one product by 1."""
    tensor = getattr(module, leaf)
    if leaf != "weight" or tensor.numel() > 0 or not hasattr(module, "cpu_linear"):
        return tensor
    eye = torch.eye(module.input_size, dtype=tensor.dtype, device=tensor.device)
    return module.cpu_linear(eye, tensor, None).t()

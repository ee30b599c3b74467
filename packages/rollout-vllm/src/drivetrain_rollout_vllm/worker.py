"""What runs inside vLLM's worker (through ``LLM.collective_rpc``): in-place reloads and weight read-back.

These are plain functions of the worker, so they run wherever vLLM put its model (in this process or in vLLM's
engine process) and travel by reference to this importable module.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch


def reload(worker: Any, weights: Sequence[tuple[str, torch.Tensor]]) -> None:
    """Load ``weights`` (Hugging Face names, checkpoint layout) in place through vLLM's reload path.

    NOTE: the model's ``load_weights`` alone is not enough: vLLM processes weights after loading (the CPU
    linears pack theirs into oneDNN and drop the parameter), and its reload path restores the checkpoint
    layout, loads, and processes again. Every tensor of a layer it touches must come in the same call (see
    :func:`layer_of`): the layer is rebuilt from what the call holds.
    """
    worker.model_runner.reload_weights(weights_iterator=list(weights), is_checkpoint_format=True)


def packed_modules(worker: Any) -> dict[str, list[str]]:
    """The model's fused layers: vLLM name -> the checkpoint modules fused into it, in order."""
    return dict(getattr(worker.model_runner.get_model(), "packed_modules_mapping", {}))


def layer_of(name: str, packed: Mapping[str, Sequence[str]]) -> tuple[str, str | None]:
    """The vLLM module serving the checkpoint tensor ``name`` and, for a fused one, the part it is
    (``model.layers.0.self_attn.k_proj.weight`` -> ``model.layers.0.self_attn.qkv_proj``, ``k_proj``)."""
    module, _, _ = name.rpartition(".")
    parent, _, short = module.rpartition(".")
    fused = next((f for f, parts in packed.items() if short in parts), None)
    return (f"{parent}.{fused}" if fused else module), (short if fused else None)


def served_weights(worker: Any, names: Sequence[str]) -> dict[str, torch.Tensor]:
    """The tensors the model computes with under each Hugging Face name, read back from vLLM's layers.

    A fused layer's part is cut out of it (``q_proj`` from ``qkv_proj``); a linear whose weight vLLM packed
    into a CPU kernel is read back through that kernel (it multiplies an identity matrix, which gives every
    weight exactly); a padded vocabulary is cut to the checkpoint's rows. A name vLLM does not serve is left out.
    """
    model = worker.model_runner.get_model()
    packed = packed_modules(worker)
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    served = {}
    for name in names:
        module_name, part = layer_of(name, packed)
        try:
            tensor = _full_parameter(model.get_submodule(module_name), name.rpartition(".")[2])
        except AttributeError:
            continue
        if part is not None:
            module = model.get_submodule(module_name)
            sizes, parts = list(module.output_sizes), list(packed[module_name.rpartition(".")[2]])
            index = parts.index(part)
            tensor = tensor.narrow(0, sum(sizes[:index]), sizes[index])
        if name in ("model.embed_tokens.weight", "lm_head.weight") and vocab is not None:
            tensor = tensor[:vocab]
        served[name] = tensor.detach().cpu().clone()
    return served


def _full_parameter(module: Any, leaf: str) -> torch.Tensor:
    """``module``'s parameter ``leaf``, or, for a weight a CPU kernel holds (vLLM left an empty parameter),
    the kernel applied to the identity: ``I @ W.T`` is ``W.T`` exactly, each output one product by 1."""
    tensor = getattr(module, leaf)
    if leaf != "weight" or tensor.numel() > 0 or not hasattr(module, "cpu_linear"):
        return tensor
    eye = torch.eye(module.input_size, dtype=tensor.dtype, device=tensor.device)
    return module.cpu_linear(eye, tensor, None).t()

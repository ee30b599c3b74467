"""What runs inside vLLM's worker (through ``LLM.collective_rpc``): in-place loads and weight read-back.

These are plain functions of the worker, so they run wherever vLLM put its model (in this process or in vLLM's
engine process) and travel by reference to this importable module.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .layers import ReadyLayer


def reload(worker: Any, weights: Sequence[tuple[str, torch.Tensor]]) -> None:
    """Load ``weights`` (Hugging Face names, checkpoint layout, every tensor of each layer they touch) in place
    through vLLM's reload path, in one call (a checkpoint restored).

    NOTE: the model's ``load_weights`` alone is not enough: vLLM processes weights after loading (the CPU
    linears pack theirs into oneDNN and drop the parameter), and its reload path restores the checkpoint
    layout, loads, and processes again.
    """
    worker.model_runner.reload_weights(weights_iterator=list(weights), is_checkpoint_format=True)


def load_layers(worker: Any, layers: Sequence[ReadyLayer]) -> None:
    """Load each layer in place through vLLM's layerwise reload: its ``rest`` read back as served
    (:func:`served_weights`), the layer opened for reloading, its tensors loaded, the layer processed (fused,
    packed) and closed, before the next layer is read.

    NOTE: vLLM opens its update window on the whole model at once (``initialize_layerwise_reload(model)``), which
    moves every layer to the meta device: a delta's unsent parts could no longer be read back, and a layer
    loaded in part is processed at the window's end from uninitialised memory for those parts (``torch.empty``
    in ``reload/meta.py``'s ``materialize_meta_tensor``). Opened on one layer, the same functions rebuild it
    from what this call holds and leave every other layer as it is.
    """
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    model = worker.model_runner.get_model()
    with set_current_vllm_config(worker.vllm_config):
        for layer in layers:
            served = served_weights(worker, layer.rest)
            module = model.get_submodule(layer.module)
            initialize_layerwise_reload(module)
            # NOTE: closed even when the load fails: a layer left open keeps the loads it buffered, counts them
            # towards the next stream's, and processes early, dropping that stream's last tensors of it.
            try:
                model.load_weights([*layer.weights, *served.items()])
            finally:
                finalize_layerwise_reload(module, worker.model_runner.model_config)


def finish_update(worker: Any) -> None:
    """After a stream's last layer: drop what vLLM derived from the old weights, as its reload path does
    (LoRA state, encoder and multimodal caches; the prefix cache is the rollout's ``_drop_caches``)."""
    runner = worker.model_runner
    runner.reset_lora_state()
    runner.reset_encoder_cache()
    runner.reset_mm_cache()


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
    served: dict[str, torch.Tensor] = {}
    # The last module's parameters, each read once for all its parts (a CPU kernel's costs a matmul).
    current, parameters = "", dict[str, torch.Tensor]()
    for name in names:
        module_name, part = layer_of(name, packed)
        leaf = name.rpartition(".")[2]
        if module_name != current:
            current, parameters = module_name, {}
        try:
            module = model.get_submodule(module_name)
            tensor = parameters.get(leaf)
            if tensor is None:
                tensor = parameters[leaf] = _full_parameter(module, leaf)
        except AttributeError:
            continue
        if part is not None:
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


def served_adapter(worker: Any, lora_id: int, name: str) -> torch.Tensor | None:
    """The tensor of the LoRA adapter ``lora_id`` vLLM holds under the PEFT name ``name``
    (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``): a fused layer's part is taken from its
    packed adapter (``q_proj``'s from ``qkv_proj``'s). ``lora_B`` is as vLLM computes with it: times the scaling.
    ``None``: the adapter or the module is not loaded.
    """
    adapter = worker.model_runner.lora_manager._adapter_manager.get_adapter(lora_id)
    stem, _, kind = name.removeprefix("base_model.model.").removesuffix(".weight").rpartition(".")
    if adapter is None or kind not in ("lora_A", "lora_B"):
        return None
    module, part = layer_of(f"{stem}.weight", packed_modules(worker))
    lora = adapter.loras.get(module)
    if lora is None:
        return None
    tensor = lora.lora_a if kind == "lora_A" else lora.lora_b
    if part is not None:
        tensor = tensor[list(packed_modules(worker)[module.rpartition(".")[2]]).index(part)]
    return None if tensor is None else tensor.detach().cpu().clone()

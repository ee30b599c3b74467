"""Independent references for engine tests: a plain, single-process Hugging Face model and plain torch.

Every function loads the model afresh with ``from_pretrained`` and runs each sequence of the batch on its
own (batch 1, no padding, no packing): the most independent computation of what an engine must produce,
sharing no code with any engine beyond the batch container and the LR schedule formula.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from tensordict import TensorDict
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

from drivetrain_engine_core._config import OptimizerConfig
from drivetrain_engine_core._data.batch import jagged
from drivetrain_engine_core._data.options import ForwardOptions
from drivetrain_engine_core._data.tokens import local_token_count
from drivetrain_engine_core._lr_schedule import lr_at_step
from drivetrain_engine_core._outputs import LossContext, LossFn

_AUTO_CLASSES = {"language_model": AutoModelForCausalLM, "value_model": AutoModelForTokenClassification}


def load_reference_model(
    model_dir: str | Path,
    model_type: str = "language_model",
    attn_implementation: str | None = None,
    *,
    dtype: torch.dtype = torch.float32,
) -> torch.nn.Module:
    """The plain Hugging Face model in ``dtype`` (float32; float64 measures float32's own round-off) and eval mode
    (no dropout), with transformers' default attention unless ``attn_implementation`` names one (``"eager"``)."""
    if model_type not in _AUTO_CLASSES:
        raise ValueError(f"model_type={model_type!r} is not supported; use one of {sorted(_AUTO_CLASSES)}.")
    model = _AUTO_CLASSES[model_type].from_pretrained(
        model_dir, dtype=dtype, attn_implementation=attn_implementation
    )
    return model.eval()


def _sequences(batch: TensorDict) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``(input_ids, position_ids)`` of each sequence, each with a leading batch dim of 1."""
    offsets = batch["input_ids"].offsets().tolist()
    ids, positions = batch["input_ids"].values(), batch["position_ids"].values()
    for start, end in itertools.pairwise(offsets):
        yield ids[start:end].unsqueeze(0), positions[start:end].unsqueeze(0)


def _shift_in_zero(per_position: torch.Tensor) -> torch.Tensor:
    """Position ``p`` predicts token ``p + 1``: move one right so index ``i`` concerns token ``i`` (docs §7.1)."""
    return torch.cat([per_position.new_zeros(1), per_position[:-1]])


def _language_outputs(
    model: torch.nn.Module, batch: TensorDict, options: ForwardOptions
) -> dict[str, torch.Tensor]:
    log_probs, entropies = [], []
    for ids, positions in _sequences(batch):
        logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits[0]
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 up, float64 kept
        logp = torch.log_softmax(logits / options.temperature, dim=-1)
        next_ids = torch.cat([ids[0, 1:], ids.new_zeros(1)])
        log_probs.append(_shift_in_zero(logp.gather(-1, next_ids[:, None]).squeeze(-1)))
        entropies.append(_shift_in_zero(-(logp.exp() * logp).sum(-1)))
    offsets = batch["input_ids"].offsets()
    outputs = {"log_probs": jagged(torch.cat(log_probs), offsets)}
    if options.compute_entropy:
        outputs["entropy"] = jagged(torch.cat(entropies), offsets)
    return outputs


def _value_outputs(model: torch.nn.Module, batch: TensorDict) -> dict[str, torch.Tensor]:
    values = []
    for ids, positions in _sequences(batch):
        scores = model(input_ids=ids, position_ids=positions).logits[0, :, 0].float()
        values.append(_shift_in_zero(scores))  # values[i] is read at the hidden state of position i - 1
    return {"values": jagged(torch.cat(values), batch["input_ids"].offsets())}


def reference_outputs(
    model: torch.nn.Module, batch: TensorDict, model_type: str, options: ForwardOptions | None = None
) -> TensorDict:
    """Per-token outputs of ``model`` for ``batch`` under ``options``, with autograd kept."""
    if model_type == "value_model":
        fields = _value_outputs(model, batch)
    else:
        fields = _language_outputs(model, batch, options or ForwardOptions())
    return TensorDict(fields, batch_size=batch.batch_size)


def reference_log_probs(
    model_dir: str | Path,
    batch: TensorDict,
    temperature: float = 1.0,
    *,
    attn_implementation: str | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Jagged ``log p(token i | tokens < i)`` at temperature ``temperature``; 0 at each sequence's start; computed
    in ``dtype`` (float64: the reference that float32's round-off is measured against)."""
    options = ForwardOptions(temperature=temperature)
    return _no_grad_field(model_dir, batch, "log_probs", options, attn_implementation, dtype)


def reference_entropy(model_dir: str | Path, batch: TensorDict, temperature: float = 1.0) -> torch.Tensor:
    """Jagged entropy of the distribution that predicts token ``i``; 0 at each sequence's start."""
    options = ForwardOptions(temperature=temperature, compute_entropy=True)
    return _no_grad_field(model_dir, batch, "entropy", options)


def reference_values(model_dir: str | Path, batch: TensorDict) -> torch.Tensor:
    """Jagged values of a value model: ``values[i]`` read at hidden state ``i - 1``; 0 at each start."""
    model = load_reference_model(model_dir, "value_model")
    with torch.no_grad():
        return _value_outputs(model, batch)["values"]


def _no_grad_field(
    model_dir: str | Path,
    batch: TensorDict,
    name: str,
    options: ForwardOptions,
    attn_implementation: str | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    model = load_reference_model(model_dir, "language_model", attn_implementation, dtype=dtype)
    with torch.no_grad():
        return _language_outputs(model, batch, options)[name]


def _loss_context(batch: TensorDict) -> LossContext:
    """The context of a single-process run over the whole batch: global counts are the batch's own."""
    return LossContext(global_token_count=local_token_count(batch), global_sequence_count=len(batch))


def _loss_and_backward(
    model: torch.nn.Module,
    batch: TensorDict,
    loss_fn: LossFn,
    model_type: str,
    options: ForwardOptions | None = None,
) -> float:
    outputs = reference_outputs(model, batch, model_type, options)
    loss, _ = loss_fn(outputs, batch, _loss_context(batch))
    loss.backward()
    return float(loss.detach())


def grad_norm(parameters: Sequence[torch.nn.Parameter]) -> float:
    """Global L2 norm of the gradients, accumulated in float64."""
    squares = sum(p.grad.double().square().sum() for p in parameters if p.grad is not None)
    return math.sqrt(float(squares))


def reference_loss_and_grad_norm(
    model_dir: str | Path,
    batch: TensorDict,
    loss_fn: LossFn,
    *,
    model_type: str = "language_model",
    options: ForwardOptions | None = None,
) -> tuple[float, float]:
    """Loss of ``loss_fn`` over the whole batch and the gradient norm of every parameter (no clipping)."""
    model = load_reference_model(model_dir, model_type)
    loss = _loss_and_backward(model, batch, loss_fn, model_type, options)
    return loss, grad_norm(list(model.parameters()))


def reference_train_losses(
    model_dir: str | Path,
    batches: Sequence[TensorDict],
    optimizer_config: OptimizerConfig,
    loss_fn: LossFn,
    *,
    model_type: str = "language_model",
) -> list[tuple[float, float]]:
    """``(loss, grad_norm)`` of each of ``len(batches)`` training steps with plain torch.

    One step: set the LR of the core schedule for this step, zero grads, forward and backward, clip to
    ``clip_grad`` (reporting the norm before clipping), and AdamW on every parameter unless the norm is not
    finite (the engine contract skips such updates).
    """
    model = load_reference_model(model_dir, model_type)
    parameters = list(model.parameters())
    optimizer = torch.optim.AdamW(
        parameters,
        lr=optimizer_config.lr,
        betas=optimizer_config.betas,
        eps=optimizer_config.eps,
        weight_decay=optimizer_config.weight_decay,
    )
    history = []
    for step, batch in enumerate(batches):
        for group in optimizer.param_groups:
            group["lr"] = lr_at_step(optimizer_config, step)
        optimizer.zero_grad(set_to_none=True)
        loss = _loss_and_backward(model, batch, loss_fn, model_type)
        norm = grad_norm(parameters)
        if optimizer_config.clip_grad is not None:
            torch.nn.utils.clip_grad_norm_(parameters, optimizer_config.clip_grad)
        if math.isfinite(norm):
            optimizer.step()
        history.append((loss, norm))
    return history

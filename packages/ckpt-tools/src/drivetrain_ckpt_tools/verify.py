"""``drivetrain ckpt verify``: does the merged directory compute what the engine computes from the checkpoint?

The merged directory is loaded with plain transformers (and peft for an adapter directory); the checkpoint
is loaded into the engine of the backend that wrote it, through the plugins. Both score the same probe
batch and the per-token outputs are compared: log-probs and entropy for language models (together they pin
down the whole next-token distribution), values for value models.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
from drivetrain_engine_core.backend import (
    CheckpointError,
    CheckpointMerger,
    ForwardOptions,
    LoraConfig,
    ModelConfig,
)
from drivetrain_engine_core.job import DrivetrainPlugins, ModelType, make_batch

from .lora import ADAPTER_CONFIG
from .merge import open_merger
from .reference import reference_outputs

DEFAULT_TOLERANCE = 1e-5
_PROBE_SEED = 1234


@dataclass(kw_only=True, frozen=True)
class VerifyResult:
    """The comparison of a merged directory with its checkpoint.

    Attributes:
        max_abs_diff: largest absolute difference over every compared per-token output.
        per_output: the largest difference for each output (``log_probs``, ``entropy``, ``values``).
        tolerance: the bound ``passed`` was judged against.
        num_tokens: tokens in the probe batch.
    """

    max_abs_diff: float
    per_output: dict[str, float]
    tolerance: float
    num_tokens: int

    @property
    def passed(self) -> bool:
        return self.max_abs_diff <= self.tolerance


def probe_sequences(vocab_size: int, *, lengths: tuple[int, ...] = (7, 13, 5), seed: int = _PROBE_SEED):
    """A fixed, seeded set of token sequences of different lengths (so packing and offsets are exercised)."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (length,), generator=generator) for length in lengths]


def verify_merged(
    dst: Path | str,
    src: Path | str,
    *,
    tolerance: float = DEFAULT_TOLERANCE,
    device: str = "cpu",
    model_path: str | None = None,
    plugins: DrivetrainPlugins | None = None,
) -> VerifyResult:
    """Compare the merged directory ``dst`` with the checkpoint step ``src`` on a probe batch; ``model_path``
    stands in for the model the checkpoint starts from when it has moved (see ``open_merger``).

    Raises:
        CheckpointError: ``dst`` is not a merged model or adapter directory, or ``src`` is not a complete step.
    """
    destination = Path(dst)
    if not (destination / "config.json").is_file() and not (destination / ADAPTER_CONFIG).is_file():
        raise CheckpointError(
            f"{destination} has neither config.json nor {ADAPTER_CONFIG}; merge first with "
            "`drivetrain ckpt merge SRC DST`."
        )
    merger = open_merger(src, model_path=model_path, plugins=plugins)
    sequences = probe_sequences(_vocab_size(merger))
    expected = reference_outputs(destination, merger, sequences, device=device)
    actual = engine_outputs(merger, sequences, device=device, plugins=plugins)
    per_output = {key: _largest_difference(actual[key], values) for key, values in expected.items()}
    return VerifyResult(
        max_abs_diff=max(per_output.values()),
        per_output=per_output,
        tolerance=tolerance,
        num_tokens=sum(len(s) for s in sequences),
    )


def _largest_difference(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> float:
    """The largest absolute difference of two lists of per-sequence outputs; infinite when either side holds a
    non-finite value.

    NOTE: Python's ``max`` over floats keeps the first NaN only (``nan > x`` is false), so a merged model with
    NaN in a later probe sequence, or in its entropy (an fp16 merge that overflowed a weight), passed.
    """
    worst = 0.0
    for a, e in zip(actual, expected, strict=True):
        if not (torch.isfinite(a).all() and torch.isfinite(e).all()):
            return math.inf
        worst = max(worst, float((a - e).abs().max()))
    return worst


def engine_outputs(
    merger: CheckpointMerger, sequences, *, device: str, plugins: DrivetrainPlugins | None
) -> dict[str, list[torch.Tensor]]:
    """Per-sequence outputs of the engine that wrote the step, loaded from it (world size 1, no optimizer)."""
    from drivetrain_engine_core.job import create_engine, engine_config_from_dict

    manifest = merger.manifest
    lora = manifest.lora
    model_config = ModelConfig(
        path=manifest.model_path,
        model_type=cast(ModelType, manifest.model_type),
        trust_remote_code=manifest.trust_remote_code,
        lora=None
        if lora is None
        else LoraConfig(**{**lora, "target_modules": tuple(lora["target_modules"])}),
    )
    engine_config = engine_config_from_dict({"backend": manifest.backend, "device": device}, plugins=plugins)
    engine = create_engine(model_config=model_config, engine_config=engine_config, plugins=plugins)
    engine.initialize()
    engine.load_checkpoint(merger.step_dir, load_optimizer=False)
    options = ForwardOptions(compute_entropy=manifest.model_type == "language_model")
    with engine.eval_mode():
        outputs = engine.infer_batch(make_batch(sequences), options=options).outputs
    if outputs is None:
        raise CheckpointError(
            f"the {manifest.backend} engine returned no outputs at world size 1; verify needs an output rank."
        )
    keys = ("log_probs", "entropy") if manifest.model_type == "language_model" else ("values",)
    return {key: [t.detach().to("cpu", torch.float32) for t in outputs[key].unbind()] for key in keys}


def _vocab_size(merger: CheckpointMerger) -> int:
    config = merger.source_config()
    vocab = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")
    if not vocab:
        raise CheckpointError(
            f"{merger.manifest.model_path}/config.json has no vocab_size to draw probe tokens."
        )
    return int(vocab)


__all__ = ["DEFAULT_TOLERANCE", "VerifyResult", "engine_outputs", "probe_sequences", "verify_merged"]
